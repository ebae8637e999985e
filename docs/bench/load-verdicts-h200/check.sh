#!/bin/bash
# Run on the device from the repository root; .gpw/ was the session's ignored device kit: the
# wheels, the GGUF in two halves, prof.py (beside this file) and ov-NAME/: the files of specd/,
# services/ and scripts/ at the compared revision that differ from this tree.
# Check 4: the services at 8, 16 and 32 clients (none, cost-aware), this tree (plain runs chained
# on the compute thread, later steps sent together) against acb9011 (mid: one-read verdicts) and
# cde0807 (before both), each overlaid on a copy; py-spy of the target and the coordinator at 8
# clients (this tree); this tree with a 1 ms GIL switch interval; two coordinators at 16 and 32
# clients; then the in-process target alone (graphs and compiled).
export PYTHONPATH=/tmp/site:$PWD SPECD_CACHE_DIR=/tmp/cache PATH=/tmp/site/bin:$PATH
D=$PWD/.gpw/mt_bench_question.jsonl
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
tree() {  # /tmp/$1: this tree with .gpw/ov-$1 overlaid
  rm -rf /tmp/$1 && mkdir /tmp/$1 && cp -r services specd scripts /tmp/$1/ && cp -r .gpw/ov-$1/* /tmp/$1/
  (cd /tmp/$1 && xargs -r rm -f < $OLDPWD/.gpw/ov-$1.deleted); diff -rq services /tmp/$1/services | wc -l
}
tree mid; tree before
PY=${PY:-python3}
B=${B:-"--dataset $D --limit 32 --max-tokens 256 --concurrency 8,16,32 --modes none,cost-aware"}
C=${C:-"--dataset $D --limit 32 --max-tokens 256 --concurrency 16,32 --modes none --coordinators 2"}
show() { grep -v "^INFO\|^WARNING\|^starting\|^wrote" | sed -n '/^c[0-9]/p;/^| level/,/^Target/p' | grep -v "^Target\|^Levels\|^$"; }
pack() { rm -f $OUT/$1/*.png; (cd $OUT && tar czf $1.tgz $1 && rm -rf $1); }
bl() {  # label, dir, timeout, extra args
  el $1; (cd $2 && PYTHONPATH=/tmp/site:$2 timeout $3 $PY -m specd bench-load ${4:-$B} --out $OUT/$1 2>&1 | show); pack $1
}
timeout ${PROF_S:-100} $PY .gpw/prof.py c8 2>&1 | tail -3 &
bl new $PWD 130; wait; (cd $OUT && tar czf prof.tgz *-c8.txt && rm -f *-c8.txt)
bl mid /tmp/mid 120
bl before /tmp/before 120
el swi; mkdir -p /tmp/swi && echo "import sys; sys.setswitchinterval(0.001)" > /tmp/swi/sitecustomize.py
(PYTHONPATH=/tmp/swi:/tmp/site:$PWD timeout 120 $PY -m specd bench-load $B --out $OUT/swi 2>&1 | show); pack swi
bl coord2 $PWD 90 "$C"
G=${G:-"--device cuda --dataset $D --prompts 4 --max-new-tokens 256 --skip-exact --skip-slow --drafters retrieval --batch-sizes 1,32 --compiled"}
el gpu; timeout 120 $PY scripts/gpu_check.py $G --out $OUT/gpu_check.json 2>&1 | grep -v "^captured" | tail -12
el done; ls -la $OUT
