# Quickstart targets: each makes .venv and installs what it needs itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-min lint docs check

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

lint: $(BIN)/.installed
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(BIN)/pyright

docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build

check: lint test docs
