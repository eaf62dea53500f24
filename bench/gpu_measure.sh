#!/usr/bin/env bash
# Issue 52's GPU measurement in one call, <= 10 minutes: run from the project tree on the lent GPU machine once the
# kit is unpacked (../shared/gpu/README.md); every result lands in $OUT (at most 8 files come back):
#   gpu.log (nvidia-smi -L, setup, each step's exit status and seconds) and results.tar (BUNDLE=0: loose files)
#   holding each step's files: pytest.log, d1_cost.{json,log} (one layer's 19 cells at d 4,096, n 1,400 train, with
#   cProfile's heaviest functions), d1_p<N>.{json,log}, extraction_cost.{json,log}, scale.{json,log}.
# Each step runs under `timeout` (SIGINT first: bench/scale.py then writes what it measured) in a process group of
# its own, which is cleared after it (the run's Ray processes); a failed step does not stop the next.
#
#   bash bench/gpu_measure.sh                      # on the GPU, after `. /tmp/gpukit/env` (sourced here if present)
#   DEVICE=cpu SHAPE=smoke OUT=/tmp/gm bash bench/gpu_measure.sh    # every command line on a CPU, reduced
# The wheels come from bench/gpu_kit.sh: `bench` (2 calls: every step but scale, which needs Ray and is then skipped,
# said so in gpu.log) or `full` (5 calls).
#
# STEPS picks the steps (a name it does not know stops the call before it starts, exit 2), in this order: pytest
# inflow d1_cost d1_parallel extraction_cost scale (the default: all six;
# inflow is bench/inflow_by_backward.py, S1/S3's inflow by the Triton kernel and by sdpa's backward against the
# chunked path's, T_INFLOW (45 s); the extraction stages take the kernel unless POOLBENCH_INFLOW_KERNEL=off), the
# opt-in extraction_chunks (extraction_cost's CHUNK_STAGES, "attention", with the inflow in chunks, no profile:
# extraction_chunks.{json,log}, T_EXTRACT: the kernel's A/B at stage level, `STEPS="extraction_cost
# extraction_chunks" STAGES=attention,all CHUNK_STAGES=attention,all PROFILE=0`), the opt-in extraction_serial
# (extraction_cost's SERIAL_STAGES, "hidden,all", with --overlap off: no preparation ahead, each chunk finished
# before the next forward, the first forward after its pooler: extraction_serial.{json,log}, T_EXTRACT: the
# overlap's A/B, `STEPS="extraction_cost extraction_serial" STAGES=hidden,all PROFILE=0`), the opt-in
# extraction_unstaged (extraction_cost's UNSTAGED_STAGES, "hidden,attention,all", with $POOLBENCH_STAGED_COPIES=0:
# each layer's pooled vectors copied to the host on the compute stream, not staged and sent in one copy a chunk on
# a copy stream: extraction_unstaged.{json,log}, T_EXTRACT: the staging's A/B, `STEPS="extraction_cost
# extraction_unstaged" STAGES=hidden,attention,all PROFILE=0`), the opt-in extraction_driver (extraction_cost at the
# driver's shape: DRIVER_STAGES, "forward_backward,all", over DRIVER_TEXTS (400) passages a concept as stored, ~126
# tokens, 32 rows a forward, one concept a job, the run's six default layers, profiled when PROFILE=1:
# extraction_driver.{json,log}, T_EXTRACT: where scale.py's 3.2-3.4x its raw forward a concept goes, beside forward
# + backward on the same batches; bench/measured/h200_session36), and
# scale_probes, which runs scale.py once per value of PROBES_SWEEP ("0 1 2": D1 probe tasks beside the extractor,
# $POOLBENCH_PROBES_PER_GPU; 0 holds them until the pooling is done) into scale_p<N>.{json,log}, T_SCALE each: `STEPS=scale_probes` is a call of its own
# (3 x ~170 s for 2 concepts at SCALE_LIMIT=200), so it fits the 8 files that come back; likewise scale_rows, which
# runs scale.py once per value of ROWS_SWEEP ("32 64": --batch-size, the rows a forward may hold; the corpus's
# ~126-token passages fill 32 rows to ~4k tokens, half the 8,192-token budget a forward) into scale_b<N>.{json,log}. d1_parallel runs
# d1_parallel.py once per value of D1_PROCS ("8": D1 probe processes at once on the GPU, the driver's most a GPU,
# D1P_CELLS (19) cells each, T_D1P each; 16 ran out of an H100's memory) into d1_p<N>.{json,log}.
# Knobs (environment): SHAPE (llama-3.1-8b), DEVICE (cuda), DTYPE (bfloat16 on cuda, float32 on cpu),
# SCALE_LIMIT (200: at most 200 passages per class and split, 800 of a concept's 2,000, ~100k tokens; `full`: the
# whole corpus, ~250k tokens a concept, which needs pooling near the issue's target to finish in T_SCALE),
# SCALE_CONCEPTS (2), SCALE_REPEATS (2: scale.py's raw forward best of two a concept; one pass left session 20's two
# concepts 1.5x apart over equal tokens, bench/measured/h100_session20), TEXTS (64: extraction_cost's 512-token
# texts per concept from the full corpus, ~65k tokens in 16-row forwards, so each stage runs seconds; the small
# corpus, the issue's baseline, holds 14k tokens: 2 forwards),
# REPEATS (2: best of two, the first warms every path), STAGES (the four the targets name), D1_CELLS (19), PROFILE
# (1: each extraction_cost stage once more under torch.profiler, its time by phase of the capture, ~1 stage more),
# T_TESTS / T_D1 / T_D1P / T_EXTRACT / T_SCALE (150 / 45 / 60 each / 280 / 200 s: each step's limit; on the H100,
# bench/measured/h100_session30, the steps took 22, 13, 28, over 212 (three of the four stages profiled in 212 s;
# extraction_cost writes its JSON after each stage) and 149 s; on the H200, bench/measured/h200_session35, the
# gpu-marked tests ran past 90 s since the inflow kernel's GPU test builds its Triton variants, ~1 s each),
# BUDGET (560 s: the whole script's wall clock from its start; a step's limit is cut to what is left of it, less the
# 5 s SIGKILL grace, and a step with under MIN_STEP (30) s left is skipped and said so, so the call ends inside the
# device tool's 600 s with every step's files bundled; a step the tool killed mid-run would lose scale.py's JSON,
# which it writes on SIGINT. Give it the call's limit less the unpack before the script: 600 s, or the device
# status's budget_left_s where less device time is left),
# GPU_TESTS (the gpu-marked test files; by
# default every tests/test_*.py that marks one, but test_steerer.py's vLLM engine start (~2.5 min) and
# test_reproduce.py's 7B run), TEST_WORKERS (4: pytest-xdist's processes for them where it imports; 1: one),
# INSTALL (1: reinstall the project from this tree into /tmp/site first, when the
# kit's env is there), PYTHON (python3).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder results go to}
mkdir -p "$OUT"
SHAPE=${SHAPE:-llama-3.1-8b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-$([ "$DEVICE" = cpu ] && echo float32 || echo bfloat16)}
SCALE_LIMIT=${SCALE_LIMIT:-200}
[ "$SCALE_LIMIT" = full ] && SCALE_LIMIT=
SCALE_CONCEPTS=${SCALE_CONCEPTS:-2}
SCALE_REPEATS=${SCALE_REPEATS:-2}
TEXTS=${TEXTS:-64}
REPEATS=${REPEATS:-2}
STAGES=${STAGES:-forward_backward,hidden,attention,all}
D1_CELLS=${D1_CELLS:-19}
T_EXTRACT=${T_EXTRACT:-280}
T_D1=${T_D1:-45}
T_SCALE=${T_SCALE:-200}
T_TESTS=${T_TESTS:-150}
PYTHON=${PYTHON:-python3}
EXTRA_EXTRACT=${EXTRA_EXTRACT:-}   # more options for extraction_cost.py (the CPU check shortens it)
PROFILE=${PROFILE:-1}              # 1: extraction_cost's stages once more under torch.profiler (--profile)
EXTRA_SCALE=${EXTRA_SCALE:-}       # more options for scale.py
EXTRA_D1=${EXTRA_D1:-}             # more options for d1_cost.py
STEPS=${STEPS:-pytest inflow d1_cost d1_parallel extraction_cost scale}
T_INFLOW=${T_INFLOW:-45}
INFLOW_ARGS=${INFLOW_ARGS:-$([ "$DEVICE" = cpu ] && echo "--rows 2 --length 128")}  # inflow's shape: 16 x 512 on a GPU
D1_PROCS=${D1_PROCS:-8}
D1P_CELLS=${D1P_CELLS:-19}
T_D1P=${T_D1P:-60}
EXTRA_D1P=${EXTRA_D1P:-}           # more options for d1_parallel.py
PROBES_SWEEP=${PROBES_SWEEP:-0 1 2}
ROWS_SWEEP=${ROWS_SWEEP:-32 64}
CHUNK_STAGES=${CHUNK_STAGES:-attention}
SERIAL_STAGES=${SERIAL_STAGES:-hidden,all}
UNSTAGED_STAGES=${UNSTAGED_STAGES:-hidden,attention,all}
DRIVER_STAGES=${DRIVER_STAGES:-forward_backward,all}
DRIVER_TEXTS=${DRIVER_TEXTS:-400}
BUDGET=${BUDGET:-560}
MIN_STEP=${MIN_STEP:-30}
LOG="$OUT/gpu.log"
started=$SECONDS

note() { echo "[$((SECONDS - started)) s] $*" | tee -a "$LOG"; }

# A step name it does not know would run nothing and the call would end "done" (session 36 lost a stage that way to
# extraction_cost's own names): every word of STEPS must be a step, or the call stops before it starts anything.
KNOWN_STEPS="pytest inflow d1_cost d1_parallel extraction_cost extraction_chunks extraction_serial extraction_unstaged
extraction_driver scale scale_probes scale_rows"
for step in $STEPS; do
  case " $(echo $KNOWN_STEPS) " in
    *" $step "*) ;;
    *) note "STEPS names no step '$step'; the steps: $(echo $KNOWN_STEPS)" >&2; exit 2 ;;
  esac
done

# run_step NAME LIMIT_S COMMAND...: its output tee'd to $OUT/NAME.log; SIGINT at the limit (cut to what is left of
# BUDGET), SIGKILL 5 s later; skipped, and said so, when under MIN_STEP s of the budget are left.
run_step() {
  local name=$1 limit=$2 t0=$SECONDS rc left
  shift 2
  left=$((BUDGET - (SECONDS - started) - 5))
  if [ "$left" -lt "$MIN_STEP" ]; then
    note "step $name skipped: $((left + 5)) s of the ${BUDGET} s budget left (limit ${limit} s)"
    return 0
  fi
  [ "$left" -lt "$limit" ] && { note "step $name: limit ${limit} s cut to ${left} s (the budget)"; limit=$left; }
  note "step $name (limit ${limit} s): $*"
  setsid timeout -s INT -k 5 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1 &
  local pid=$!
  wait "$pid"
  rc=$?
  kill -KILL -- "-$pid" 2>/dev/null || true  # what the step left behind in its group (Ray's processes)
  note "step $name: exit $rc in $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (timed out)')"
  bundle
}

# bundle: every file in $OUT but gpu.log appended to $OUT/results.tar and removed, so however many steps run, at
# most 8 files come back (the device tool's limit) and a run killed mid-step still returns what finished.
bundle() {
  [ "${BUNDLE:-1}" = 1 ] || return 0
  local f
  for f in "$OUT"/*; do
    case "$(basename "$f")" in gpu.log | results.tar) continue ;; esac
    [ -f "$f" ] && tar -rf "$OUT/results.tar" -C "$OUT" "$(basename "$f")" && rm -f "$f"
  done
}

note "PoolBench GPU measurement at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%FT%TZ)"
{ nvidia-smi -L 2>&1 || echo "no nvidia-smi"; } | tee -a "$LOG"
if [ -f /tmp/gpukit/env ]; then
  # shellcheck disable=SC1091
  . /tmp/gpukit/env
  if [ "${INSTALL:-1}" = 1 ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . \
      >> "$LOG" 2>&1 && note "project reinstalled into /tmp/site" || note "reinstall FAILED (going on)"
  fi
fi
"$PYTHON" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda',
torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1 | tee -a "$LOG"

wants() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# scale.py runs the driver, which needs Ray: the short lease's kit (bench/gpu_kit.sh bench) carries none.
if { wants scale || wants scale_probes || wants scale_rows; } && ! "$PYTHON" -c "import ray" 2>/dev/null; then
  note "steps scale, scale_probes and scale_rows skipped: Ray does not import here (bench/gpu_kit.sh full carries it)"
  STEPS=" $STEPS "; STEPS=${STEPS// scale_probes / }; STEPS=${STEPS// scale_rows / }; STEPS=${STEPS// scale / }
fi

if [ -z "${GPU_TESTS:-}" ]; then
  GPU_TESTS=$(grep -l "mark\.gpu" tests/test_*.py | grep -v -e test_steerer.py -e test_reproduce.py | tr '\n' ' ')
fi
# The gpu-marked tests in TEST_WORKERS (4) processes where pytest-xdist imports (the GPU image has it): the inflow
# kernel's GPU test builds its Triton variants on one host core per process (over 50 s alone on a fresh H200,
# bench/measured/h200_session35), so its two dtypes and the other files build and run side by side.
PARALLEL=()
if [ "${TEST_WORKERS:-4}" -gt 1 ] && "$PYTHON" -c "import xdist" 2>/dev/null; then
  PARALLEL=(-n "${TEST_WORKERS:-4}" --dist worksteal)
fi
# shellcheck disable=SC2086
wants pytest && run_step pytest "$T_TESTS" "$PYTHON" -m pytest -p no:cacheprovider -o addopts="-ra" "${PARALLEL[@]}" \
  -m "gpu and not slow" $GPU_TESTS

# shellcheck disable=SC2086
wants inflow && run_step inflow "$T_INFLOW" "$PYTHON" bench/inflow_by_backward.py --device "$DEVICE" --dtype "$DTYPE" \
  --out "$OUT/inflow.json" $INFLOW_ARGS

wants d1_cost && run_step d1_cost "$T_D1" "$PYTHON" bench/d1_cost.py --path batched --threads 1 --cells "$D1_CELLS" --profile 40 \
  --s3-heads 32 --out "$OUT/d1_cost.json" $EXTRA_D1
if wants d1_parallel; then
  for n in $D1_PROCS; do
    # shellcheck disable=SC2086
    run_step "d1_p$n" "$T_D1P" "$PYTHON" bench/d1_parallel.py --processes "$n" --cells "$D1P_CELLS" \
      --out "$OUT/d1_p$n.json" $EXTRA_D1P
  done
fi

extract_args=(--shape "$SHAPE" --device "$DEVICE" --dtype "$DTYPE" --corpus-size full --concepts 2 --texts "$TEXTS"
              --max-length 512 --pack-to 512 --repeats "$REPEATS")
# shellcheck disable=SC2086
wants extraction_cost && run_step extraction_cost "$T_EXTRACT" "$PYTHON" bench/extraction_cost.py "${extract_args[@]}" \
  --stages "$STAGES" $([ "$PROFILE" = 1 ] && echo --profile) --out "$OUT/extraction_cost.json" $EXTRA_EXTRACT
# The same stages with S1/S3's inflow in query chunks (the kernel's fallback), for the A/B on one warm machine
# shellcheck disable=SC2086
wants extraction_chunks && POOLBENCH_INFLOW_KERNEL=off run_step extraction_chunks "$T_EXTRACT" "$PYTHON" \
  bench/extraction_cost.py "${extract_args[@]}" --stages "$CHUNK_STAGES" --out "$OUT/extraction_chunks.json" $EXTRA_EXTRACT
# The same stages with the host's work in series with the device (--overlap off), the overlap's A/B
# shellcheck disable=SC2086
wants extraction_serial && run_step extraction_serial "$T_EXTRACT" "$PYTHON" bench/extraction_cost.py \
  "${extract_args[@]}" --stages "$SERIAL_STAGES" --overlap off --out "$OUT/extraction_serial.json" $EXTRA_EXTRACT
# The same stages with each layer copied out on the compute stream (no staging on the device), the staging's A/B
# shellcheck disable=SC2086
wants extraction_unstaged && POOLBENCH_STAGED_COPIES=0 run_step extraction_unstaged "$T_EXTRACT" "$PYTHON" \
  bench/extraction_cost.py "${extract_args[@]}" --stages "$UNSTAGED_STAGES" --out "$OUT/extraction_unstaged.json" \
  $EXTRA_EXTRACT
# The driver's shape: passages as stored (~126 tokens), its batch size, its six layers, one concept a job
# shellcheck disable=SC2086
wants extraction_driver && run_step extraction_driver "$T_EXTRACT" "$PYTHON" bench/extraction_cost.py \
  --shape "$SHAPE" --device "$DEVICE" --dtype "$DTYPE" --corpus-size full --concepts 2 --texts "$DRIVER_TEXTS" \
  --max-length 512 --pack-to 0 --layers driver --concepts-per-job 1 --repeats "$REPEATS" --stages "$DRIVER_STAGES" \
  $([ "$PROFILE" = 1 ] && echo --profile) --out "$OUT/extraction_driver.json" $EXTRA_EXTRACT

scale_args=(--shape "$SHAPE" --device "$DEVICE" --dtype "$DTYPE" --concepts "$SCALE_CONCEPTS" --corpus-size full
            --max-length 512 --repeats "$SCALE_REPEATS" ${SCALE_LIMIT:+--limit "$SCALE_LIMIT"})
# shellcheck disable=SC2086
wants scale && run_step scale "$T_SCALE" "$PYTHON" bench/scale.py "${scale_args[@]}" --out "$OUT/scale.json" $EXTRA_SCALE
# scale_sweep STEP TAG OPTION VALUES: scale.py once per value of OPTION, each a step scale_<TAG><value> of its own
scale_sweep() {
  local step=$1 tag=$2 option=$3 n
  wants "$step" || return 0
  for n in $4; do
    # shellcheck disable=SC2086
    run_step "scale_$tag$n" "$T_SCALE" "$PYTHON" bench/scale.py "${scale_args[@]}" "$option" "$n" \
      --out "$OUT/scale_$tag$n.json" $EXTRA_SCALE
  done
}
scale_sweep scale_probes p --probes-per-gpu "$PROBES_SWEEP"
scale_sweep scale_rows b --batch-size "$ROWS_SWEEP"
note "done in $((SECONDS - started)) s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
