# Two commands for a newcomer: `make demo` (tune a built-in model on this CPU) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test install bench clean compose-test compose-up compose-down
install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

demo: install
	$(PY) -m sharetune demo

# the module boundaries first (pyproject.toml [tool.importlinter]): seconds, before the suite. The suite runs in
# TEST_WORKERS processes (pytest-xdist), a test file per process at a time, each process with its own session
# stack (Redis, planner, tuner, updater, lanes). One process left the two cores idle while a test waited on a
# process or a TTL; two keep them ~90 % busy: 13 min -> 8 on a 2-core host.
# Files are handed out longest first (--no-loadscope-reorder keeps the order tests/conftest.py collects them in):
# no long file is left for the end, run by one process while the other has nothing left
TEST_WORKERS ?= 2
test: install
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check services shared sharetune bench tests
	$(VENV)/bin/mypy shared
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 -m "not gpu" tests

# the compose stack built, started, used, scaled and broken (tests/compose/run.sh): Docker is installed and
# started if missing, and left as found
compose-test: install
	PY=$(abspath $(PY)) bash tests/compose/run.sh

# the compose stack's CPU profile on this host, as docs/operations.md describes it (deploy/compose/up.sh): Docker
# installed and started where it is missing and can be, base images stood in for where Docker Hub is out of reach
compose-up:
	bash deploy/compose/up.sh up

compose-down:
	bash deploy/compose/up.sh down

# the time-to-quality benchmark rehearsed on this CPU (5-20 min on 2 cores; docs/time_to_quality.md), under $OUT
# (default /tmp/out), not over bench/results
bench: install
	$(PY) -m bench.time_to_quality --rehearse --models efficientnet-mbconv --trials 16 --per-iter 8 \
		--tuners 1 --warm-from tiny --warm-trials 16

clean:
	rm -rf runs .pytest_cache
