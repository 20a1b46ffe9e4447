"""Cut links, on the two-host system in network namespaces (tests.integration.agent.system): the public link of a
host training a single arm, longer than its lease, and the private link between the pair's ranks mid-pair. Each
ends in a state that recovers by itself, and each arm's final parameters are bit-identical to an uninterrupted
run's of the same prepared inputs."""

from __future__ import annotations

import datetime
import hashlib
import json
import sqlite3
import threading
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


# Short of the lease (heartbeats resume before it lapses), long enough to fail the agent's sends and their retries.
UPLOAD_CUT_SECONDS = 3.0
UPLOADING_ARM = "damaged-single"
# The pair's private link is cut as its rank 1 reports this update: past the first checkpoint (4), short of the next.
PAIR_CUT_STEP = 5


@dataclass
class Cuts:
    single_arm: str
    single_host: str
    pair_job: str
    uploading_host: str  # the host whose public link was cut as UPLOADING_ARM finished, during its uploads
    uploads_cut_at: datetime.datetime


class SpoolCut(threading.Thread):
    """Watches the agents' spools (what the commands printed, the moment the agent reads it) for ``arm``'s ``rank``
    reporting ``step``, and at once cuts that host's ``link`` for ``seconds``. Watching the spool, not the
    coordinator's events, puts the cut where the training is, not where its uploads have got to."""

    def __init__(
        self, run: System, topology: dict[str, Any], arm: str, rank: int, step: int, link: str, seconds: float
    ) -> None:
        super().__init__(name=f"cut-{arm}", daemon=True)
        self.system, self.topology = run, topology
        self.arm, self.rank, self.step, self.link, self.seconds = arm, rank, step, link, seconds
        self.host: str | None = None
        self.cut_at: datetime.datetime | None = None
        self.failure: BaseException | None = None
        self.stop = threading.Event()

    def _reached_on(self) -> str | None:
        for name, agent in self.system.agents.items():
            steps = agent.spooled_bodies("step")
            if any(
                s.get("arm") == self.arm and s.get("rank") == self.rank and s.get("step", 0) >= self.step for s in steps
            ):
                return name
        return None

    def run(self) -> None:
        try:
            self._watch()
        except BaseException as exc:  # the fixture reports it
            self.failure = exc

    def _watch(self) -> None:
        while not self.stop.wait(0.05):
            if (host := self._reached_on()) is not None:
                self.cut_at = datetime.datetime.now(datetime.UTC)
                cut_link(self.topology, host, self.link, self.seconds).wait(timeout=60)
                self.host = host
                return

    def finish(self) -> str:
        """The host that was cut, once its link is up again."""
        self.join(timeout=600)
        assert self.failure is None, self.failure
        assert self.host is not None, f"{self.arm}'s rank {self.rank} was never seen to reach update {self.step}"
        return self.host


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
    # UPLOADING_ARM's host loses its public link as the arm finishes, during its uploads.
    uploads = SpoolCut(run, topology, UPLOADING_ARM, 0, COUNTS["updates"], "public", UPLOAD_CUT_SECONDS)
    # The pair's rank 1 host loses its private link past the collective timeout, between its first two checkpoints.
    pair_cut = SpoolCut(run, topology, "clean-pair", 1, PAIR_CUT_STEP, "private", COLLECTIVE_TIMEOUT_SECONDS + 4)
    for watch in (uploads, pair_cut):
        watch.start()
    try:
        return _cut_single(run, topology, uploads, pair_cut)
    finally:
        for watch in (uploads, pair_cut):
            watch.stop.set()


def _cut_single(run: System, topology: dict[str, Any], uploads: SpoolCut, pair_cut: SpoolCut) -> Cuts:
    # A single arm's host loses its public link for twice the lease, while the arm trains.
    wait_for(lambda: len(run.rank_steps("clean-single", 0)) >= 2, 600, "clean-single to train a few steps")
    (attempt,) = run.attempts("train", "clean-single")
    host = run.host_of(attempt)
    cut_link(topology, host, "public", 2 * LEASE_SECONDS).wait(timeout=60)
    # The rest of the experiment is not this test's: it ends with the training (no evaluation, no replica).
    operate(run.server, f"/api/experiments/{run.experiment['id']}/autopilot", {"on": False})
    (pair,) = [j for j in run.jobs() if j["arm"] == "clean-pair"]
    pair_cut.finish()
    run.wait_state({"trained"}, 900)
    uploading_host = uploads.finish()
    assert uploads.cut_at is not None
    return Cuts("clean-single", host, pair["id"], uploading_host, uploads.cut_at)


def test_a_single_whose_host_lost_its_public_link_past_the_lease_is_retried_to_the_same_parameters(
    cut: tuple[System, Cuts], tmp_path: Path
) -> None:
    run, cuts = cut
    attempts = run.attempts("train", cuts.single_arm)
    assert attempts[0]["state"] == "lost" and "lease expired" in attempts[0]["reason"], attempts
    assert [a["state"] for a in attempts[1:]] == ["succeeded"], attempts  # one retry, which finished
    assert run.model_identity(cuts.single_arm) == run.uninterrupted(cuts.single_arm, 1, TINY, tmp_path)
    # What the cut cost, from the bundle: the updates the lost attempt was heard to finish past where its retry
    # resumed, and more time than the lease the coordinator waited before it declared the attempt lost.
    (fault,) = run.faults(cuts.single_arm, tmp_path / "bundle")
    heard = max(run.rank_steps_of(attempts[0]))
    assert fault.ended == ["lost"] and fault.resumed_from_step == run.resumed_from(attempts[1:]).pop()
    # A lost attempt may finish its run while cut off: its retry then resumes from the final update (no update
    # recomputed) and reports that run's result again.
    assert fault.updates_recomputed == max(0, heard - fault.resumed_from_step)
    assert fault.seconds_lost > LEASE_SECONDS


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
    faults = run.faults("clean-pair", tmp_path / "bundle")
    assert [f.generation for f in faults] == list(range(1, last))
    # The first generation's cost: the updates heard past the checkpoint both resumed from (none when the cut held
    # the next all-reduce), and more time than the collective's timeout.
    heard = max(s for a in attempts if a["number"] == 1 for s in run.rank_steps_of(a))
    assert faults[0].updates_recomputed == heard - faults[0].resumed_from_step
    assert faults[-1].resumed_from_step == resumed.pop()
    assert faults[0].seconds_lost > COLLECTIVE_TIMEOUT_SECONDS


def test_uploads_across_a_cut_public_link_arrive_once_each_and_nothing_is_lost(cut: tuple[System, Cuts]) -> None:
    run, cuts = cut
    *_, last = run.attempts("train", UPLOADING_ARM)
    assert last["state"] == "succeeded" and run.host_of(last) == cuts.uploading_host, last
    agent = run.agents[cuts.uploading_host]
    with sqlite3.connect(agent.work_dir / "spool.sqlite3") as db:
        rows = db.execute("SELECT kind, body, state FROM uploads WHERE attempt_id = ?", (last["id"],)).fetchall()
    # The agent's own record: every upload of the attempt was acknowledged, none refused.
    assert rows and {state for _, _, state in rows} == {"acknowledged"}, rows
    batches = [json.loads(body) for kind, body, _ in rows if kind == "events"]
    spooled = [e for batch in batches for e in batch["events"]]
    # The coordinator holds each event the agent spooled, once, in order, from every batch.
    events = [e for e in run.server.get(f"/api/attempts/{last['id']}/events")["items"] if e["sequence"] is not None]
    assert [(e["kind"], e["body"]) for e in events] == [(e["kind"], e["body"]) for e in spooled]
    sequences = sorted(b["sequence"] for b in batches)
    assert sorted({e["sequence"] for e in events}) == sequences == list(range(len(batches)))
    # The result crossed the cut: the coordinator recorded it only after the link went down.
    states = [e for e in run.server.get(f"/api/attempts/{last['id']}/events")["items"] if e["kind"] == "state"]
    (ended,) = [e for e in states if e["body"]["to"] == "succeeded"]
    assert datetime.datetime.fromisoformat(ended["at"]) > cuts.uploads_cut_at
    resumed = run.resumed_from([last]).pop()
    steps = [e["body"]["step"] for e in events if e["kind"] == "step"]
    assert steps == list(range(resumed + 1, COUNTS["updates"] + 1))
    # The evidence it recorded is the run's files on the host, byte for byte.
    listed = {f["path"]: f["sha256"] for f in run.server.get(f"/api/experiments/{run.experiment['id']}/evidence")}
    folder = agent.work_dir / "experiments" / run.experiment["id"] / "home" / "runs" / UPLOADING_ARM / "rank-0"
    for name in ("result.json", "run.json"):
        local = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        assert listed[f"runs/{UPLOADING_ARM}/rank-0/{name}"] == local
