# Two commands for a newcomer: `make demo` (tune a built-in model on this CPU) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test install bench clean compose-test
install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

demo: install
	$(PY) -m sharetune demo

# the module boundaries first (pyproject.toml [tool.importlinter]): seconds, before an 11-minute suite
test: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q --durations=25 -m "not gpu" tests

# the compose stack built, started, used, scaled and broken (tests/compose/run.sh): Docker is installed and
# started if missing, and left as found
compose-test: install
	PY=$(abspath $(PY)) bash tests/compose/run.sh

bench: install
	$(PY) bench/cpu_tuning.py

clean:
	rm -rf runs .pytest_cache
