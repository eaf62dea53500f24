# PoolBench. `make run` runs the main job on the embedded default; `make test` runs the tests.
# Both install first (idempotent): a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel on this machine; on a GPU cluster use e.g. TORCH_SPEC="torch --index-url <cuda index>".
TORCH_SPEC ?= torch==2.13.0
RUN_OUT ?= runs/default
RUN_ARGS ?=
PYTEST_ARGS ?=
RAY_PORT ?= 6379

.PHONY: install run test test-slow lint bench cluster-up cluster-down clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $@

run: install
	$(BIN)/poolbench-driver run --out $(RUN_OUT) $(RUN_ARGS)

test: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: install
	$(BIN)/python -m pytest -q -m "slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python bench/extract_pool.py

cluster-up: install
	$(BIN)/ray start --head --port=$(RAY_PORT) --disable-usage-stats
	@echo "Ray head up; run: $(BIN)/poolbench-driver run --address auto"

cluster-down:
	-$(BIN)/ray stop

clean:
	rm -rf $(VENV) runs .poolbench-cache
