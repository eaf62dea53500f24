#!/usr/bin/env bash
# One layer's 19 cells in two one-core processes at once, variant A (torch's factors) then B (lapack_factors), twice.
set -u
PY=${PY:-.venv/bin/python}
out=${OUT:-/tmp/s25/ab}; mkdir -p "$out"
here=$(dirname "$0")
pair() {
  local name=$1 v=$2
  echo "$name start $(date -u +%T)"
  for i in 1 2; do $PY "$here/d1_cost_variant.py" "$v" --path batched --threads 1 --layers 1 --out "$out/${name}_$i.json" > "$out/${name}_$i.log" 2>&1 & done
  wait
  echo "$name end $(date -u +%T)"; grep -h "a cell" "$out/${name}"_*.log
}
pair A1 A; pair B1 B; pair A2 A; pair B2 B
