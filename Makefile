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

# The whole suite: unit tests, store tests on SQLite and PostgreSQL, functional tests against
# the real SGLang engine on CPU.
test: install-test
	$(PY) -m pytest -q -ra --durations=30

# Unit tests and the gateway tier (well under a minute): no engine process, no SGLang, no torch.
# tests/gateway serves the real gateway app in front of the simulator, both in process.
test-fast: install-test
	$(PY) -m pytest -q tests/unit tests/gateway -m "not slow"

check: install-test
	scripts/check

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
