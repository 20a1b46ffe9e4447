"""The coordinator survives SIGKILL at any moment of its writes, and the loss of its host. One experiment of the
local-SGD design (no kill point is in serving, so no vLLM) runs to its report through two agents, on SQLite and on
Postgres, while:
- the coordinator kills itself (server.failpoints, a real SIGKILL) at each named point in turn: during a blob upload
  (bytes on the disk, not yet under their name; under their name, no row yet), as a commitment is added, as a result
  settles, and as the report job writes and stores the report. After each death, before the restart, the test reads
  the database and the blob store as they were left: the ledger's hash chain verifies, every blob's file hashes to
  its name, and no row names a file or blob that is not there;
- once the first gang has trained, `coop-server backup` copies the live coordinator, which is then killed with its
  home; `coop-server restore` puts the copy into a new home (and, on Postgres, a new database), and a coordinator on
  it takes the old one's address. The agents, which never stopped, carry the second gang's training across it.
The run ends with the report of the same experiment run undisturbed: the same verdict and counts, final digests
(the arm trained across the restore included) and test answers; and the exported evidence recomputes to it."""

from __future__ import annotations

import hashlib
import io
import signal
import tarfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core.errors import CoopError
from experiment.core.ledger import decode_ledger, verify_ledger
from experiment.report.recompute import compute
from experiment.seed import seedmodel
from server import models
from server.store import commitments
from server.store.blobstore import INCOMING
from tests.integration.agent.support import AgentProcess
from tests.integration.agent.system import System, local_sgd_plan
from tests.support import database
from tests.support.database import with_session
from tests.support.processes import QUICK, CoordinatorProcess, coop_server_events, stop_process
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

# Each point kills the coordinator on the visit named, counted from its last start; they come in this order in a run.
# The backup, the coordinator's death and the restore come between the two lists, once the first gang has trained.
KILLS_BEFORE_BACKUP = (
    "blob.received:1",
    "blob.installed:2",
    "commitment.appended:1",  # the prepared inputs' commitment, as the prepare job's result settles
)
KILLS_AFTER_RESTORE = (
    "result.settled:2",  # a result of the second gang, which trains across the restore
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


class Run(System):
    """A coordinator on ``database_url`` and two agents on loopback, and one experiment of the two-rank local-SGD
    plan."""

    @classmethod
    def start(cls, tmp: Path, seed: tuple[Path, seedmodel.Snapshot], database_url: str | None) -> Run:
        home = tmp / "coordinator"
        home.mkdir(parents=True)
        # A lease that outlasts a restart, so that an agent's attempts are not lost while the coordinator is down.
        environment = {**QUICK, "COOP_LEASE_SECONDS": "12", "COOP_HEARTBEAT_SECONDS": "0.5", "COOP_MAX_ATTEMPTS": "6"}
        server = Coordinator(home, database_url, **environment)
        agents: dict[str, AgentProcess] = {}
        try:
            server.start()
            for name in ("host-a", "host-b"):
                agents[name] = AgentProcess(server, name, tmp / name, seed[0], server.agent_token(name))
                agents[name].start()
            experiment = server.create_experiment(local_sgd_plan(tmp / "plan.toml", seed[1]))
        except BaseException:
            for agent in agents.values():  # a run that could not start leaves no process behind
                agent.stop()
            server.close()
            raise
        return cls(server, agents, experiment, {})

    @property
    def id(self) -> str:
        experiment_id: str = self.experiment["id"]
        return experiment_id

    def reported(self) -> bool:
        """Whether the experiment is reported; a failed job fails the test at once, with its attempts' reasons."""
        failed = [j for j in self.jobs() if j["state"] == "failed"]
        assert not failed, self.failure(failed)
        return self.state() == "reported"

    def outcome(self) -> dict[str, Any]:
        """What an undisturbed run must equal: the verdict and counts, the arms' final digests, the test answers."""
        report = self.server.get(f"/api/experiments/{self.id}/report")
        answers = self.server.get(f"/api/experiments/{self.id}/answers?role=test&limit=1000")["items"]
        return {
            "verdict": report["local_sgd"]["verdict"],
            "noninferiority": report["local_sgd"]["noninferiority"],
            "candidates": report["candidates"],
            "digests": {a["name"]: a["model_identity"] for a in self.server.get(f"/api/experiments/{self.id}/arms")},
            "answers": sorted((a["arm"], a["answer"]["index"], a["answer"]["output_ids"]) for a in answers),
        }

    def kill_at(self, point: str) -> None:
        """Restart the coordinator to die at ``point``, wait for its death, and check what it left."""
        server = self.server
        assert isinstance(server, Coordinator)
        server.stop()
        server.environment["COOP_FAILPOINTS"] = point
        server.start()
        process = server.process
        assert process is not None
        wait_for(lambda: server.killed_or(self.reported), 600, lambda: f"the kill at {point}\n{self.describe()}")
        assert process.poll() == -signal.SIGKILL, f"{point}: the run reached its report before the point"
        assert left_behind(server.home, server.database_url, self.id) == [], f"after the kill at {point}"
        server.process = None
        server.environment.pop("COOP_FAILPOINTS")

    def back_up_and_restore(self, folder: Path, empty_database: str | None) -> list[str]:
        """Once a gang has trained: back the live coordinator up, kill it, restore the backup into a new home (and
        ``empty_database``) and start it there at the same address. The arms not yet trained at the backup."""
        server = self.server
        server.start()
        self.wait_job("train", {"succeeded"}, 300)
        untrained = [j["arm"] for j in self.jobs() if j["kind"] == "train" and j["state"] != "succeeded"]
        backed_up = coop_server_events("backup", "--out", str(folder / "backup.tar"), **server.environment)
        assert server.process is not None
        stop_process(server.process, signal.SIGKILL)  # the coordinator's host is gone, and its home with it
        server.process = None
        old_home = server.home
        server.rehome(folder / "restored", empty_database)
        restored = coop_server_events("restore", "--from", str(folder / "backup.tar"), **server.environment)
        assert restored[-1]["event"] == "restored" and restored[-1]["blobs"] == backed_up[-1]["blobs"] > 0
        # The home's secret came along (the web sessions and the probes' tokens derive from it).
        assert (server.home / "web-secret").read_bytes() == (old_home / "web-secret").read_bytes()
        return untrained


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
def undisturbed(
    tmp_path_factory: pytest.TempPathFactory, small_seed: tuple[Path, seedmodel.Snapshot]
) -> dict[str, Any]:
    """The outcome of the same experiment run without a fault: the truth both recorded runs must end at."""
    run = Run.start(tmp_path_factory.mktemp("undisturbed"), small_seed, None)
    try:
        wait_for(run.reported, 600, lambda: f"the undisturbed run's report\n{run.describe()}")
        return run.outcome()
    finally:
        run.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def databases(request: pytest.FixtureRequest) -> Iterator[tuple[str | None, str | None]]:
    """The coordinator's database URL and the empty one its backup is restored into (None, None: SQLite files in
    the homes)."""
    if request.param == "sqlite":
        yield None, None
        return
    admin = database.postgres_admin_url()
    made = [database.create_postgres_database(admin) for _ in range(2)]
    try:
        if None in made:
            pytest.fail(
                f"no Postgres server answers at {admin}: run `make services` (as root), or set COOP_TEST_POSTGRES_URL"
            )
        yield made[0], made[1]
    finally:
        for url in made:
            if url is not None:
                database.drop_postgres_database(admin, url)


def test_the_coordinator_killed_at_each_point_of_its_writes_and_restored_from_a_live_backup_reports_as_undisturbed(
    undisturbed: dict[str, Any],
    databases: tuple[str | None, str | None],
    small_seed: tuple[Path, seedmodel.Snapshot],
    tmp_path: Path,
) -> None:
    original, empty = databases
    run = Run.start(tmp_path, small_seed, original)
    try:
        for point in KILLS_BEFORE_BACKUP:
            run.kill_at(point)
        untrained = run.back_up_and_restore(tmp_path, empty)
        for point in KILLS_AFTER_RESTORE:
            run.kill_at(point)
        run.server.start()
        wait_for(run.reported, 600, lambda: f"the report after the last kill\n{run.describe()}")
        home = run.server.home
        assert left_behind(home, run.server.database_url, run.id) == []
        assert not any((home / "blobs" / INCOMING).iterdir())  # a restart clears what a dead upload left
        outcome = run.outcome()
        ledger = run.server.get(f"/api/experiments/{run.id}/ledger")
        report = run.server.get(f"/api/experiments/{run.id}/report")
        exported = run.server.http.get(f"/api/experiments/{run.id}/evidence.tar")
        assert [j for j in run.jobs() if j["state"] == "failed"] == []
    finally:
        run.stop()
    # One gang trained across the backup and the restore, to the parameters of the undisturbed run's.
    assert len(untrained) == 1
    assert outcome == undisturbed
    assert [e["kind"] for e in ledger] == ["plan", "prepared", "selection", "tested", "report"]
    # The report, verdict and counts, is what the exported evidence recomputes to.
    assert exported.status_code == 200
    bundle = tmp_path / "exported"
    with tarfile.open(fileobj=io.BytesIO(exported.content)) as tar:
        tar.extractall(bundle, filter="data")
    verify_ledger(decode_ledger((bundle / "ledger.json").read_bytes(), "ledger.json"))
    recomputed = msgspec.to_builtins(compute(bundle))
    assert {**recomputed, "ledger_entries": len(ledger) - 1} == report
    assert report["local_sgd"]["verdict"]["conditions"]
