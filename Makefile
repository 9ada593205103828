# Switchyard — the two commands users need: `make test` and `make demo`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# make test runs its own services in their own folder, so a user's `switchyard services up` is left alone
TEST_HOME := $(CURDIR)/.switchyard/test

.PHONY: install lint test test-cluster test-unit demo services-up services-down clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy --strict schemas/ routing/

# Everything: lint, then the whole suite against the real Kafka broker and Redis it starts (and stops).
test: lint
	SWITCHYARD_HOME=$(TEST_HOME) $(BIN)/python -m switchyard.testrun -- \
		$(BIN)/pytest -q -ra --durations=25 --timeout=300 $(PYTEST_ARGS)

# The cluster suite (tests/clusters, and tests/state on the Redis Cluster): a 3-broker KRaft
# Kafka and a 3-primary Redis Cluster with one replica each, started and stopped here. Apart
# from `make test` because three brokers and six redis-servers do not fit its 20 minutes on a
# small machine; .ci/run runs both.
test-cluster: install
	SWITCHYARD_HOME=$(CURDIR)/.switchyard/test-cluster $(BIN)/python -m switchyard.testrun --clusters -- \
		$(BIN)/pytest -q -ra --durations=15 --timeout=600 tests/clusters tests/state \
		tests/integration/test_end_to_end.py $(PYTEST_ARGS)

# The pure suite only (no Kafka, no Redis).
test-unit: install
	$(BIN)/pytest -q -m "not integration and not faults" $(PYTEST_ARGS)

demo: install
	$(BIN)/python -m switchyard.demo

services-up: install
	$(BIN)/switchyard services up

services-down: install
	$(BIN)/switchyard services down

clean:
	rm -rf $(VENV) .switchyard services/kafka/libs *.egg-info
