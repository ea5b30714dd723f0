# Quickstart targets: each makes .venv and installs what it needs itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-min test-latest lint docs serve-docs check .venv-bench

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=25.1"
	$(BIN)/python -m pip install --quiet -e ".[demo,tensorboard,wandb]" --group dev
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python -m eqxctx.demo $(ARGS)

test: $(BIN)/.installed
	$(BIN)/python -m pytest --hypothesis-profile=ci $(ARGS)

# The test suite on the oldest core dependencies pyproject.toml allows.
MIN_VENV := .venv-min
$(MIN_VENV)/bin/.installed: pyproject.toml .ci/min-versions.txt
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install --quiet --upgrade "pip>=25.1"
	$(MIN_VENV)/bin/python -m pip install --quiet -c .ci/min-versions.txt \
		-e ".[demo,tensorboard]" --group test
	touch $@

test-min: $(MIN_VENV)/bin/.installed
	$(MIN_VENV)/bin/python -m pytest --hypothesis-profile=ci -p no:cacheprovider $(ARGS)

# The tests of what eqxctx takes from JAX's internals (name scopes, the trace identity,
# shardings) on the newest JAX pip gives, which needs a newer Python than 3.11 (JAX
# 0.11 on): run with the newest Python 3.12+ found here, or skipped with a note.
LATEST_VENV := .venv-latest
LATEST_PYTHON := $(shell .ci/latest-python)
LATEST_TESTS := tests/test_scope.py tests/test_host_cost.py tests/test_iterations.py \
	tests/test_collection.py tests/test_mapping.py tests/test_sharding.py \
	tests/test_context.py tests/test_public_api.py

$(LATEST_VENV)/bin/.installed: pyproject.toml
	$(LATEST_PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade "pip>=25.1"
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade -e ".[demo,tensorboard]" \
		--group test
	touch $@

test-latest:
ifeq ($(LATEST_PYTHON),)
	@echo "test-latest: skipped, no Python 3.12 or newer here (the newest JAX needs one)"
else
	$(MAKE) $(LATEST_VENV)/bin/.installed
	$(LATEST_VENV)/bin/python -c "import sys, jax; print('test-latest:', sys.version.split()[0], 'jax', jax.__version__)"
	$(LATEST_VENV)/bin/python -m pytest --hypothesis-profile=ci -p no:cacheprovider \
		$(LATEST_TESTS) $(ARGS)
endif

# A benchmark venv: the dev venv's requirements plus Flax, for
# benchmarks/bench_capture_nnx.py (nnx.capture beside eqxctx.capture). Not used by
# CI or `make test`: `make .venv-bench`, then .venv-bench/bin/python benchmarks/...
BENCH_VENV := .venv-bench
$(BENCH_VENV)/bin/.installed: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade "pip>=25.1"
	$(BENCH_VENV)/bin/python -m pip install --quiet -e ".[demo,tensorboard,wandb]" \
		--group dev "flax>=0.12.8"
	touch $@

.venv-bench: $(BENCH_VENV)/bin/.installed

lint: $(BIN)/.installed
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(BIN)/pyright

docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build

# The docs site at http://127.0.0.1:8000, rebuilt as the pages change.
serve-docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve $(ARGS)

check: lint test docs
