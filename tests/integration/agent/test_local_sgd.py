"""The local-SGD experiment (plans/local-diloco.toml's arms) through a real coordinator and four real agents, each
in a network namespace of its own, the gangs' collectives on the hosts' one shared private link shaped to
200 Mbit/s at every host, through one fault: the host of DiLoCo's rank 3 killed (SIGKILL, agent and commands)
past its first checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from experiment.core.ledger import Entry, verify_ledger
from experiment.learning import stats
from tests.integration.agent import system
from tests.integration.agent.system import System
from tests.support import ROOT
from tests.support.hosts import hosts

pytestmark = pytest.mark.slow
PLAN = ROOT / "plans" / "local-diloco.toml"
RANKS = 4
# 24 updates, a checkpoint and an outer step every 4, so that the kill lands between two outer steps; DiLoCo's
# published outer step, so that the resumed workers carry a momentum that is not zero.
COUNTS: dict[str, Any] = {
    "train": 184,
    "replay": 8,
    "updates": 24,
    "checkpoint_steps": [4, 8, 12, 16, 20, 24],
    "sync_every": 4,
    "outer_learning_rate": 0.7,
    "outer_momentum": 0.9,
}
TESTS = 16  # tests/conftest.py SMALL_COUNTS


@pytest.fixture(scope="module")
def reported(
    tmp_path_factory: pytest.TempPathFactory, small_seed: tuple[Path, Any]
) -> Iterator[tuple[System, str, str]]:
    """The experiment to its report; yields the run, DiLoCo's train job and the host killed during it."""
    tmp = tmp_path_factory.mktemp("local-sgd")
    with hosts("local-sgd", rate="200mbit", count=RANKS) as topology:
        run = system.start(tmp, small_seed, topology, COUNTS, lease_seconds=10, base=PLAN)
        try:
            job, killed = run.kill_rank_past("diloco-4", 3, COUNTS["checkpoint_steps"][0])
            run.wait_state({"reported"}, 900)
            yield run, job, killed
        finally:
            run.stop()


def test_the_local_sgd_experiment_is_reported_on_its_own_criteria(reported: tuple[System, str, str]) -> None:
    run, _, _ = reported
    experiment_id = run.experiment["id"]
    ledger = run.server.get(f"/api/experiments/{experiment_id}/ledger")
    assert [entry["kind"] for entry in ledger] == ["plan", "prepared", "selection", "tested", "report"]
    verify_ledger([Entry(**entry) for entry in ledger])
    assert not [job for job in run.jobs() if job["kind"] in {"replica-start", "benchmark"}]
    report = run.server.get(f"/api/experiments/{experiment_id}/report")
    assert report["design"] == "local-sgd" and report["primary"] is None and report["serving"] is None
    # The non-inferiority test's counts are the stored test answers' own.
    page = run.server.get(f"/api/experiments/{experiment_id}/answers?role=test&limit=1000")
    correct = {
        arm: {item["answer"]["id"]: item["answer"]["check"]["correct"] for item in page["items"] if item["arm"] == arm}
        for arm in ("ddp-4", "diloco-4")
    }
    wins, losses = stats.paired_counts(correct["ddp-4"], correct["diloco-4"])
    test = report["local_sgd"]["noninferiority"]
    assert (test["n"], test["wins"], test["losses"]) == (TESTS, wins, losses)
    assert test["p_value"] == pytest.approx(stats.noninferiority_p_value(wins, losses, TESTS, 0.05), rel=1e-9)
    conditions = {c["name"]: c["passed"] for c in report["local_sgd"]["verdict"]["conditions"]}
    assert report["local_sgd"]["verdict"]["passed"] == all(conditions.values()) and len(conditions) == 2


def test_each_rank_wrote_what_the_ring_all_reduce_sends_and_its_private_link_carried_it(
    reported: tuple[System, str, str], small_seed: tuple[Path, Any]
) -> None:
    run, _, _ = reported
    report = run.server.get(f"/api/experiments/{run.experiment['id']}/report")
    parameters = small_seed[1].parameters
    updates = COUNTS["updates"]
    per_synchronization = 2 * (RANKS - 1) / RANKS * 4 * parameters
    for arm, synchronizations in (("ddp-4", updates), ("diloco-4", updates // COUNTS["sync_every"])):
        communication = report["local_sgd"]["communication"][arm]
        assert communication["synchronizations"] == synchronizations
        assert communication["theory_bytes_per_rank"] == pytest.approx(synchronizations * per_synchronization)
        training = report["training"][arm]
        for rank, written in enumerate(training["written_bytes"]):
            # The ring's payload, and little else: each update's loss all-reduce and the rank's progress lines.
            assert (
                synchronizations * per_synchronization
                <= written
                <= synchronizations * per_synchronization + (updates * 4096)
            ), (arm, rank, written)
        # The kernel's count of the private interface, headers and all, carried at least the rank's writes (a
        # resumed rank's counters start at its resume: per update, over the updates it ran).
        assert training["private_interface"] == "priv0"
        for sent, written in zip(training["private_bytes_per_update"], training["written_bytes"], strict=True):
            assert sent >= 0.9 * per_synchronization * synchronizations / updates, (arm, sent, written)
    ratio = report["local_sgd"]["diloco_over_control_bytes"]
    assert ratio == pytest.approx(1 / COUNTS["sync_every"], rel=0.1)


def test_a_killed_diloco_worker_resumes_at_an_outer_step_to_the_uninterrupted_digest(
    reported: tuple[System, str, str], tmp_path: Path, small_seed: tuple[Path, Any]
) -> None:
    run, job, _ = reported
    attempts = run.server.get(f"/api/jobs/{job}/attempts")
    first = {x["rank"]: x["state"] for x in attempts if x["number"] == 1}
    assert set(first.values()) <= {"lost", "cancelled"} and "lost" in first.values(), attempts
    retry = [x for x in attempts if x["number"] == 2]
    assert sorted((x["rank"], x["state"]) for x in retry) == [(rank, "succeeded") for rank in range(RANKS)]
    resumed = run.resumed_from(retry)
    # Every worker resumed from one step, an outer step every worker held.
    assert len(resumed) == 1 and all(step > 0 and step % COUNTS["sync_every"] == 0 for step in resumed), resumed
    assert run.model_identity("diloco-4") == run.uninterrupted("diloco-4", RANKS, small_seed[0], tmp_path)
    page = run.server.http.get(f"/experiments/{run.experiment['id']}/report")
    assert page.status_code == 200 and 'data-testid="noninferiority"' in page.text
    assert 'data-testid="communication"' in page.text


def test_the_arms_page_shows_how_each_arm_synchronizes_and_what_its_ranks_sent(
    reported: tuple[System, str, str],
) -> None:
    run, _, _ = reported
    page = run.server.http.get(f"/experiments/{run.experiment['id']}/arms")
    assert page.status_code == 200
    outer = f'data-testid="outer-steps-diloco-4">{COUNTS["updates"] // COUNTS["sync_every"]}</strong>'
    assert outer in page.text and "a gradient all-reduce over 4 ranks every update" in page.text
    assert 'data-testid="written-ddp-4-3"' in page.text and 'data-testid="outer-steps-ddp-4"' not in page.text
