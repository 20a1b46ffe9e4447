"""Two real vLLM (CPU) replicas of a trained checkpoint of the tiny seed, each behind a probe that checked its
answers against the HF evaluation of that checkpoint, started once for the session."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiment.core.plan import load_plan
from experiment.learning import corpus, evaluation, training
from experiment.seed import seedmodel
from tests.conftest import write_plan
from tests.integration.serving.support import TINY, Fleet, Trained
from tests.support.processes import coop_train

WORKLOAD = 16  # dev tasks in the test workload: enough for a replica to be stopped mid-phase
STARTUP_SECONDS = 900  # a replica takes 45 s to minutes to become healthy on two busy cores


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """A home prepared on the committed tiny seed, its clean-single arm trained (a few updates, checkpoints in the
    seed's layout), and that checkpoint's dev evaluation by HF: the answers every replica must reproduce."""
    folder = tmp_path_factory.mktemp("serving")
    plan_path = write_plan(folder / "plan.toml", seedmodel.snapshot_of(TINY), dev=WORKLOAD, workload_tasks=WORKLOAD)
    home = folder / "home"
    corpus.prepare(load_plan(plan_path), plan_path, home, TINY, None, lambda event: None)
    [done] = coop_train(home, TINY, "clean-single", 1)
    assert done.returncode == 0, done.stderr
    result = json.loads((training.run_dir(home, "clean-single", 0) / "result.json").read_bytes())
    model_dir = training.run_dir(home, "clean-single", 0) / "checkpoints" / result["candidate"]["checkpoint"] / "model"
    evaluation.evaluate(home, TINY, "clean-single", "dev", None, lambda event: None)
    reference = evaluation.evaluation_dir(home, "dev", "clean-single")
    return Trained(home=home, model_dir=model_dir, identity=result["parameter_digest"], reference=reference)


@pytest.fixture(scope="session")
def serving_home(trained: Trained) -> Path:
    return trained.home


@pytest.fixture(scope="session")
def serving_token() -> str:
    return secrets.token_urlsafe(24)


@pytest.fixture(scope="session")
def fleet(trained: Trained, serving_token: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    served = Fleet(trained, serving_token, tmp_path_factory.mktemp("serving-logs"))
    try:
        yield served
    finally:
        served.close()


@pytest.fixture
def pair(fleet: Fleet) -> list[str]:
    """The probe URLs of both replicas, healthy (the first serving test starts both at once)."""
    return [s.probe_url for s in fleet.ensure(2, STARTUP_SECONDS)]


@pytest.fixture
def probe_url(fleet: Fleet) -> str:
    """The first replica's probe URL, healthy (tests that need one replica do not start the second)."""
    return fleet.ensure(1, STARTUP_SECONDS)[0].probe_url
