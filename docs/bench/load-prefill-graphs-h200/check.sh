#!/bin/bash
# Run on the device from the repository root; .gpw/ov-mid held the files of 60ef14a that differ
# from this tree (specd/models/graphs.py).
# Check 5: one-row prefill graph buckets (this tree) against the code before them (60ef14a,
# .gpw/ov-mid), none at 1, 8 and 16 clients, 16 MT-bench prompts, 256 tokens.
export PYTHONPATH=/tmp/site:$PWD SPECD_CACHE_DIR=/tmp/cache
D=$PWD/.gpw/mt_bench_question.jsonl
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PY=${PY:-python3}
rm -rf /tmp/mid && mkdir /tmp/mid && cp -r services specd scripts /tmp/mid/ && cp -r .gpw/ov-mid/* /tmp/mid/
diff -rq specd /tmp/mid/specd | wc -l
B=${B:-"--dataset $D --limit 16 --max-tokens 256 --concurrency 1,8,16 --modes none"}
show() { grep -v "^INFO\|^WARNING\|^starting\|^wrote" | sed -n '/^| level/,/^Target/p' | grep -v "^Target\|^Levels\|^$"; }
bl() {
  el $1; (cd $2 && PYTHONPATH=/tmp/site:$2 timeout $3 $PY -m specd bench-load $B --out $OUT/$1 2>&1 | show)
  grep -h "captured\|CUDA graphs" /tmp/specd-bench-load-*/target.log 2>/dev/null | tail -2; rm -rf /tmp/specd-bench-load-*
  rm -f $OUT/$1/*.png
}
bl prefill $PWD 95
bl before /tmp/mid 85
el done
