#!/bin/bash
# Run on the device from the repository root; .gpw/ was the session's ignored device kit: the
# wheels and the embedded GGUF (setup.sh unpacked them into /tmp/site) and the MT-bench questions.
# Check 6: through the services on the GPU, (a) does cost-aware still lose to none under load
# now that prefill is graphed, and (b) do graphs of compiled layers (--cuda-graphs compiled,
# with the one-row prefill buckets) start and serve faster than plain graphs? 16 MT-bench
# prompts, 256 tokens, 1 / 8 / 16 clients.
export PYTHONPATH=/tmp/site:$PWD SPECD_CACHE_DIR=/tmp/cache
D=$PWD/.gpw/mt_bench_question.jsonl
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PY=${PY:-python3}
B="--dataset $D --limit 16 --max-tokens 256 --concurrency 1,8,16 --modes none,cost-aware"
show() { grep -v "^INFO\|^WARNING\|^starting\|^wrote" | sed -n '/^| level/,/^Target/p' | grep -v "^Target\|^Levels\|^$"; }
bl() {
  el $1; timeout $2 $PY -m specd bench-load $B "${@:3}" --out $OUT/$1 2>&1 | show
  grep -h "captured\|CUDA graphs\|compil" /tmp/specd-bench-load-*/target.log 2>/dev/null | tail -3
  mkdir -p $OUT/$1 && cp /tmp/specd-bench-load-*/target.log $OUT/$1/ 2>/dev/null; rm -rf /tmp/specd-bench-load-*
  rm -f $OUT/$1/*.png
}
nvidia-smi --query-gpu=name --format=csv,noheader
bl graphs 200
bl compiled 250 --target-flags "--cuda-graphs compiled"
el done
