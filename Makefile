# The two commands of the README. Both create .venv if missing and install what they need
# (idempotent: scripts/install skips work already done).
.PHONY: serve test test-fast check install install-test clean

VENV ?= .venv
PY := $(VENV)/bin/python

install:
	scripts/install

install-test:
	scripts/install --test

# Creates the built-in tiny model, upgrades the database, starts the engine and the gateway on
# port 8000. Needs TANDEM_ADMIN_TOKEN (a development token is used if it is unset).
serve: install
	TANDEM_ADMIN_TOKEN=$${TANDEM_ADMIN_TOKEN:-dev-admin-token} $(VENV)/bin/tandem serve

# Workers for the tests that start no engine: one per core, at most 4.
PARALLEL := --numprocesses=auto --maxprocesses=4

# The whole suite: unit tests, store tests on SQLite and PostgreSQL, functional tests against
# the real SGLang engine on CPU. Two runs: the tests that start no engine on every core, then
# the `serial` ones (the slow functional tests: the real engine, timings compared within a run)
# one at a time, alone on the machine. Both always run; the status is the first failure's.
test: install-test
	@status=0; \
	$(PY) -m pytest -q -ra -m "not serial" $(PARALLEL) --durations=15 || status=$$?; \
	$(PY) -m pytest -q -ra -m serial --durations=30 || status=$$?; \
	exit $$status

# Unit tests and the gateway tier (a few minutes): no engine process, no SGLang, no torch.
# tests/gateway serves the real gateway app in front of the simulator, both in process.
test-fast: install-test
	$(PY) -m pytest -q tests/unit tests/gateway -m "not slow" $(PARALLEL)

check: install-test
	scripts/check

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
