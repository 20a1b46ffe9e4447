"""Two real vLLM (CPU) replicas of the tiny seed, each behind a probe, started once for the session."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiment import corpus, seedmodel
from experiment.plan import load_plan
from tests.conftest import write_plan
from tests.integration.serving.support import TINY, Fleet

WORKLOAD = 16  # dev tasks in the test workload: enough for a replica to be stopped mid-phase
STARTUP_SECONDS = 900  # a replica takes 45 s to minutes to become healthy on two busy cores


@pytest.fixture(scope="session")
def serving_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home prepared on the committed tiny seed, the model the local plan serves."""
    folder = tmp_path_factory.mktemp("serving")
    plan_path = write_plan(folder / "plan.toml", seedmodel.snapshot_of(TINY), dev=WORKLOAD, workload_tasks=WORKLOAD)
    home = folder / "home"
    corpus.prepare(load_plan(plan_path), plan_path, home, TINY, None, lambda event: None)
    return home


@pytest.fixture(scope="session")
def serving_token() -> str:
    return secrets.token_urlsafe(24)


@pytest.fixture(scope="session")
def fleet(serving_home: Path, serving_token: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    served = Fleet(serving_home, serving_token, tmp_path_factory.mktemp("serving-logs"))
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
