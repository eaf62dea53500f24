#!/usr/bin/env bash
# one layer's 19 cells in two processes at once: 9993d9b (session 18's measured tree), then HEAD, then 9993d9b again
set -u
PY=/work/main/.venv/bin/python
out=/tmp/s24/ab; mkdir -p $out
pair() {  # name, tree, pythonpath
  local name=$1 tree=$2 pp=$3
  echo "$name start $(date -u +%T)"
  for i in 1 2; do (cd $tree && PYTHONPATH=$pp $PY bench/d1_cost.py --path batched --threads 1 --layers 1 --out $out/${name}_$i.json > $out/${name}_$i.log 2>&1) & done
  wait
  echo "$name end $(date -u +%T)"; grep -h "a cell" $out/${name}_*.log
}
pair old1 /tmp/old_tree /tmp/old_pkg
pair new1 /work/main ""
pair old2 /tmp/old_tree /tmp/old_pkg
pair new2 /work/main ""
