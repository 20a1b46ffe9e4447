# coop: `make run` runs the whole experiment locally; `make test` runs lint, types and tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint typecheck unit seed clean

setup: $(STAMP)

# Idempotent: reinstalls only when pyproject.toml or the constraints change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check experiment server agent tests bench
	$(BIN)/ruff format --check experiment server agent tests bench

typecheck: setup
	$(BIN)/mypy --strict experiment server agent

unit: setup
	$(BIN)/python -m pytest tests/unit tests/integration -q

test: lint typecheck unit

# Today: prepare and train the three arms of the local plan in a fresh home under .coop/
# (the singles in parallel, then the pair as two ranks through torchrun).
run: setup
	@home=.coop/home-$$(date -u +%Y%m%dT%H%M%SZ); set -e; \
	$(BIN)/coop plan show plans/local.toml; \
	$(BIN)/coop prepare --plan plans/local.toml --home $$home --model-dir seeds/tiny; \
	$(BIN)/coop train --home $$home --model-dir seeds/tiny --arm clean-single > $$home.clean-single.log & a=$$!; \
	$(BIN)/coop train --home $$home --model-dir seeds/tiny --arm damaged-single > $$home.damaged-single.log & b=$$!; \
	wait $$a; wait $$b; tail -n 1 $$home.clean-single.log $$home.damaged-single.log; \
	OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc-per-node 2 -m experiment.cli train --home $$home \
		--model-dir seeds/tiny --arm clean-pair | tail -n 2; \
	echo "results under $$home/runs"

clean:
	rm -rf .coop
