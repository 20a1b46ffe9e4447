"""The coordinator survives SIGKILL at any moment of its writes. One experiment runs to its report through two
agents while the coordinator kills itself (server.failpoints, a real SIGKILL) at each named point in turn: during a
blob upload (bytes on the disk, not yet under their name; under their name, no row yet), as a commitment is added,
as a result settles, and as the report job writes and stores the report. After each death, before the restart,
the test reads the database and the blob store as they were left: the ledger's hash chain verifies, every blob's
file hashes to its name, and no row names a file or blob that is not there. The run ends with the report of the
same experiment run undisturbed: the same verdict, counts, final digests and test answers. On SQLite and Postgres."""

from __future__ import annotations

import hashlib
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core.errors import CoopError
from experiment.core.ledger import verify_ledger
from experiment.seed import seedmodel
from server import models
from server.store import commitments
from server.store.blobstore import INCOMING
from tests.conftest import write_plan
from tests.integration.agent.support import AgentProcess
from tests.support import ROOT
from tests.support.database import create_postgres_database, drop_postgres_database, postgres_admin_url, with_session
from tests.support.processes import QUICK, CoordinatorProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

TINY = ROOT / "seeds" / "tiny"  # vLLM serves it (the seconds-fast test seed is too small for its kernels)
# Each point kills the coordinator on the visit named, counted from its last start; they come in this order in a run.
KILLS = (
    "blob.received:1",
    "blob.installed:2",
    "commitment.appended:1",  # the prepared inputs' commitment, as the prepare job's result settles
    "result.settled:2",  # a training rank's result
    "commitment.appended:1",  # the selection
    "result.settled:1",
    "report.written:1",
    "report.stored:1",
)


class Coordinator(CoordinatorProcess):
    """A coordinator that may die at its failpoint while it starts (an agent's spooled upload arrives at once)."""

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() == -signal.SIGKILL:
            return True
        return super()._answers()

    def killed_or(self, reached: Callable[[], bool]) -> bool:
        """Whether the process died, or else ``reached()`` holds (asked only while it answers)."""
        if self.process is None or self.process.poll() is not None:
            return True
        try:
            return reached()
        except httpx.TransportError:
            return False


class Run:
    """A coordinator on ``database_url`` and two agents on loopback, and one experiment of the small plan."""

    def __init__(self, tmp: Path, database_url: str | None) -> None:
        self.home = tmp / "coordinator"
        self.home.mkdir(parents=True)
        # A lease that outlasts a restart, so that an agent's attempts are not lost while the coordinator is down.
        environment = {**QUICK, "COOP_LEASE_SECONDS": "12", "COOP_HEARTBEAT_SECONDS": "0.5", "COOP_MAX_ATTEMPTS": "6"}
        self.server = Coordinator(self.home, database_url, **environment)
        self.agents: list[AgentProcess] = []
        try:
            self.server.start()
            self.agents = [
                AgentProcess(self.server, name, tmp / name, TINY, self.server.agent_token(name))
                for name in ("host-a", "host-b")
            ]
            for agent in self.agents:
                agent.start()
            # The small plan's training, and a serving workload long enough for the failure phase's stop to land
            # midway.
            plan = write_plan(tmp / "plan.toml", seedmodel.snapshot_of(TINY), dev=16, workload_tasks=16)
            self.experiment: dict[str, Any] = self.server.create_experiment(plan)
        except BaseException:
            self.stop()  # a run that could not start leaves no process behind
            raise
        self.id = self.experiment["id"]

    def state(self) -> str:
        state: str = self.server.get(f"/api/experiments/{self.id}")["state"]
        return state

    def reported(self) -> bool:
        """Whether the experiment is reported; a failed job fails the test at once, with its attempts' reasons."""
        failed = [j for j in self.server.jobs(self.id) if j["state"] == "failed"]
        reasons = [a["reason"] for j in failed for a in self.server.get(f"/api/jobs/{j['id']}/attempts")]
        assert not failed, f"failed jobs {[(j['kind'], j['arm']) for j in failed]}: {reasons}"
        return self.state() == "reported"

    def outcome(self) -> dict[str, Any]:
        """What an undisturbed run must equal: the verdict and counts, the arms' final digests, the test answers."""
        report = self.server.get(f"/api/experiments/{self.id}/report")
        arms = {a["name"]: a["model_identity"] for a in self.server.get(f"/api/experiments/{self.id}/arms")}
        answers = self.server.get(f"/api/experiments/{self.id}/answers?role=test&limit=1000")["items"]
        return {
            "verdict": report["primary"]["verdict"],
            "primary": {k: v for k, v in report["primary"].items() if k != "verdict"},
            "candidates": report["candidates"],
            "digests": arms,
            "answers": sorted((a["arm"], a["answer"]["index"], a["answer"]["output_ids"]) for a in answers),
        }

    def stop(self) -> None:
        for agent in self.agents:
            agent.stop()
        self.server.close()


def left_behind(home: Path, database_url: str, experiment_id: str) -> list[str]:
    """What a dead coordinator left that breaks a rule; empty when its database and blob store are whole."""

    async def read(session: AsyncSession) -> tuple[list[Any], set[str], list[tuple[str, str]]]:
        entries = await commitments.entries(session, uuid.UUID(experiment_id))
        blobs = set(await session.scalars(select(models.Blob.sha256)))
        evidence = [(row.path, row.sha256) for row in await session.scalars(select(models.EvidenceFile))]
        return entries, blobs, evidence

    entries, blobs, evidence = with_session(database_url, read)
    problems = []
    try:
        verify_ledger(entries)
    except CoopError as exc:
        problems.append(f"ledger: {exc}")
    store = home / "blobs"
    for sha256 in sorted(blobs):
        path = store / sha256[:2] / sha256
        if not path.is_file():
            problems.append(f"blob row {sha256} has no file")
    for path in store.glob("??/*"):
        if hashlib.sha256(path.read_bytes()).hexdigest() != path.name:
            problems.append(f"blob file {path.name} does not hash to its name")
    problems += [
        f"evidence {path} names blob {sha256}, which has no row" for path, sha256 in evidence if sha256 not in blobs
    ]
    for entry in entries:
        blob = entry.body.get("blob") if isinstance(entry.body, dict) else None
        if blob is not None and blob not in blobs:
            problems.append(f"commitment {entry.seq} ({entry.kind}) names blob {blob}, which has no row")
    return problems


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = Run(tmp_path_factory.mktemp("undisturbed"), None)
    try:
        wait_for(run.reported, 900, "the undisturbed run's report")
        return run.outcome()
    finally:
        run.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str | None]:
    if request.param == "sqlite":
        yield None  # the coordinator's own file under its home
        return
    admin = postgres_admin_url()
    created = create_postgres_database(admin)
    if created is None:
        pytest.fail(f"no Postgres server answers at {admin}: run `make services` (as root)")
    try:
        yield created
    finally:
        drop_postgres_database(admin, created)


def test_the_coordinator_killed_at_each_point_of_its_writes_restarts_whole_and_reports_as_undisturbed(
    undisturbed: dict[str, Any], database_url: str | None, tmp_path: Path
) -> None:
    run = Run(tmp_path, database_url)
    try:
        for point in KILLS:
            run.server.stop()
            run.server.environment["COOP_FAILPOINTS"] = point
            run.server.start()
            process = run.server.process
            assert process is not None
            wait_for(lambda: run.server.killed_or(run.reported), 900, f"the kill at {point}")
            assert process.poll() == -signal.SIGKILL, f"{point}: the run reached its report before the point"
            problems = left_behind(run.home, run.server.database_url, run.id)
            assert problems == [], f"after the kill at {point}: {problems}"
            run.server.process = None
        run.server.environment.pop("COOP_FAILPOINTS")
        run.server.start()
        wait_for(run.reported, 900, "the report after the last kill")
        assert left_behind(run.home, run.server.database_url, run.id) == []
        assert not any((run.home / "blobs" / INCOMING).iterdir())  # a restart clears what a dead upload left
        assert run.outcome() == undisturbed
        failed = [j for j in run.server.jobs(run.id) if j["state"] == "failed"]
        assert failed == []
    finally:
        run.stop()
