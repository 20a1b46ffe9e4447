"""Cut links, on the two-host system in network namespaces (tests.integration.agent.system): the public link of a
host training a single arm, longer than its lease, and the private link between the pair's ranks mid-pair. Each
ends in a state that recovers by itself, and each arm's final parameters are bit-identical to an uninterrupted
run's of the same prepared inputs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from experiment.seed import seedmodel
from tests.integration.agent import system
from tests.integration.agent.system import System
from tests.support import ROOT
from tests.support.hosts import cut_link, hosts
from tests.support.scenarios import operate
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow
TINY = ROOT / "seeds" / "tiny"
LEASE_SECONDS = 8.0
# A collective waits this long for its peer before the rank gives up (the plan's runtime.collective_timeout_seconds,
# at its least): the cut below outlasts it, and is mended before the retried gang meets again.
COLLECTIVE_TIMEOUT_SECONDS = 10.0
COUNTS: dict[str, Any] = {**system.COUNTS, "collective_timeout_seconds": COLLECTIVE_TIMEOUT_SECONDS}


@dataclass
class Cuts:
    single_arm: str
    single_host: str
    pair_job: str


@pytest.fixture(scope="module")
def cut(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[System, Cuts]]:
    with hosts("cuts") as topology:
        run = system.start(
            tmp_path_factory.mktemp("cuts"),
            (TINY, seedmodel.snapshot_of(TINY)),
            topology,
            COUNTS,
            lease_seconds=LEASE_SECONDS,
        )
        try:
            yield run, _cuts(run, topology)
        finally:
            run.stop()


def _cuts(run: System, topology: dict[str, Any]) -> Cuts:
    # A single arm's host loses its public link for twice the lease, while the arm trains.
    wait_for(lambda: len(run.rank_steps("clean-single", 0)) >= 2, 600, "clean-single to train a few steps")
    (attempt,) = run.attempts("train", "clean-single")
    host = run.host_of(attempt)
    cut_link(topology, host, "public", 2 * LEASE_SECONDS).wait(timeout=60)
    # The pair's rank 1 host loses its private link past the collective timeout, between checkpoints.
    wait_for(lambda: len(run.rank_steps("clean-pair", 1)) >= 6, 600, "the pair to pass its first checkpoint")
    (pair,) = [j for j in run.jobs() if j["arm"] == "clean-pair"]
    rank1 = next(a for a in run.attempts("train", "clean-pair") if a["rank"] == 1)
    # The rest of the experiment is not this test's: it ends with the training (no evaluation, no replica).
    operate(run.server, f"/api/experiments/{run.experiment['id']}/autopilot", {"on": False})
    cut_link(topology, run.host_of(rank1), "private", COLLECTIVE_TIMEOUT_SECONDS + 4).wait(timeout=60)
    run.wait_state({"trained"}, 900)
    return Cuts("clean-single", host, pair["id"])


def test_a_single_whose_host_lost_its_public_link_past_the_lease_is_retried_to_the_same_parameters(
    cut: tuple[System, Cuts], tmp_path: Path
) -> None:
    run, cuts = cut
    attempts = run.attempts("train", cuts.single_arm)
    assert attempts[0]["state"] == "lost" and "lease expired" in attempts[0]["reason"], attempts
    assert [a["state"] for a in attempts[1:]] == ["succeeded"], attempts  # one retry, which finished
    assert run.model_identity(cuts.single_arm) == run.uninterrupted(cuts.single_arm, 1, TINY, tmp_path)


def test_a_pair_whose_private_link_was_cut_is_retried_from_a_shared_checkpoint_to_the_same_parameters(
    cut: tuple[System, Cuts], tmp_path: Path
) -> None:
    run, cuts = cut
    attempts = run.server.get(f"/api/jobs/{cuts.pair_job}/attempts")
    first = {a["rank"]: a["state"] for a in attempts if a["number"] == 1}
    # A rank's collective timed out, so it ended lost (a link failure, not the run's) and its peer was cancelled
    # with it, or ended lost too.
    assert set(first.values()) <= {"lost", "cancelled"} and "lost" in first.values(), attempts
    last = max(a["number"] for a in attempts)
    assert sorted((a["rank"], a["state"]) for a in attempts if a["number"] == last) == [
        (0, "succeeded"),
        (1, "succeeded"),
    ]
    resumed = run.resumed_from([a for a in attempts if a["number"] == last])
    # Both ranks resumed from one checkpoint, one both held.
    assert len(resumed) == 1 and resumed <= set(COUNTS["checkpoint_steps"]), resumed
    assert run.model_identity("clean-pair") == run.uninterrupted("clean-pair", 2, TINY, tmp_path)
