"""Backups that restore (server.backup), through real processes: a coordinator and two agents run an experiment;
mid-run, `coop-server backup` copies the live coordinator, which is then killed; `coop-server restore` puts the copy
into a new home (and, on Postgres, a new database), a coordinator on it takes the old one's address, and the agents,
which never stopped, carry the experiment on to the report an undisturbed run gives. And a restore refuses a
target that is not empty or an archive that is not whole, writing nothing."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from experiment.core.ledger import decode_ledger, verify_ledger
from experiment.report.recompute import compute
from experiment.seed import seedmodel
from server import migrate
from server.settings import sqlite_url
from tests.conftest import write_plan
from tests.integration.agent.support import AgentProcess
from tests.integration.agent.system import System
from tests.support import ROOT, database
from tests.support.processes import QUICK, CoordinatorProcess, stop_process

pytestmark = pytest.mark.slow
RANKS = 2  # each arm's gang: one rank on each of the two hosts


def coop_server(*args: str, **environment: str) -> subprocess.CompletedProcess[str]:
    """``coop-server ARGS`` with COOP_* ``environment``, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "server", *args],
        cwd=ROOT,
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _local_sgd_plan(path: Path, seed: seedmodel.Snapshot) -> Path:
    """The local-SGD design on two ranks (its report needs no replica, so no vLLM): the cheapest plan that a
    coordinator and two agents take through prepare, two gangs' training, tests and the report."""
    plan_file = write_plan(
        path, seed, ROOT / "plans" / "local-diloco.toml", sync_every=2, outer_learning_rate=0.7, outer_momentum=0.9
    )
    plan = msgspec.toml.decode(plan_file.read_bytes())
    for arm in plan["arms"]:
        if "ranks" in arm:
            arm["ranks"] = RANKS
            arm["name"] = arm["name"].replace("-4", f"-{RANKS}")
    plan["hosts"]["count"] = RANKS
    path.write_bytes(msgspec.toml.encode(plan))
    return path


@pytest.fixture
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


def _events(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("databases", ["sqlite", "postgres"], indirect=True)
def test_a_backup_of_the_running_coordinator_restores_and_the_experiment_goes_on_to_the_same_report(
    tmp_path: Path, small_seed: tuple[Path, seedmodel.Snapshot], databases: tuple[str | None, str | None]
) -> None:
    original, empty = databases
    home = tmp_path / "coordinator"
    home.mkdir()
    server = CoordinatorProcess(home, original, **QUICK, COOP_LEASE_SECONDS="10", COOP_HEARTBEAT_SECONDS="0.5")
    server.start()
    agents = {
        name: AgentProcess(server, name, tmp_path / name, small_seed[0], server.agent_token(name))
        for name in ("host-a", "host-b")
    }
    for agent in agents.values():
        agent.start()
    run = System(server, agents, server.create_experiment(_local_sgd_plan(tmp_path / "plan.toml", small_seed[1])), {})
    try:
        run.wait_job("train", {"succeeded"}, 300)
        untrained = [j["arm"] for j in run.jobs() if j["kind"] == "train" and j["state"] != "succeeded"]
        backed_up = _events(coop_server("backup", "--out", str(tmp_path / "backup.tar"), **server.environment))
        assert server.process is not None
        stop_process(server.process, signal.SIGKILL)  # the coordinator's host is gone, and its home with it
        server.process = None

        restored_home = tmp_path / "restored"
        server.rehome(restored_home, empty)
        restored = _events(coop_server("restore", "--from", str(tmp_path / "backup.tar"), **server.environment))
        assert restored[-1]["event"] == "restored" and restored[-1]["blobs"] == backed_up[-1]["blobs"] > 0
        # The home's secret came along (the web sessions and the probes' tokens derive from it).
        assert (restored_home / "web-secret").read_bytes() == (home / "web-secret").read_bytes()
        server.start()  # at the same address: the agents, which went on with their work, find it there
        run.wait_state({"reported"}, 300)
        experiment_id = run.experiment["id"]
        ledger = server.get(f"/api/experiments/{experiment_id}/ledger")
        identities = {arm: run.model_identity(arm) for arm in untrained}
        report = server.get(f"/api/experiments/{experiment_id}/report")
        exported = server.http.get(f"/api/experiments/{experiment_id}/evidence.tar")
    finally:
        run.stop()
    assert [e["kind"] for e in ledger] == ["plan", "prepared", "selection", "tested", "report"]
    # The other arm trained across the backup and the restore, to the parameters of its training without a fault.
    assert len(untrained) == 1
    for arm in untrained:
        assert identities[arm] == run.uninterrupted(arm, RANKS, small_seed[0], tmp_path / "uninterrupted")
    # The report, verdict and counts, is what the exported evidence recomputes to.
    assert exported.status_code == 200
    bundle = tmp_path / "exported"
    with tarfile.open(fileobj=io.BytesIO(exported.content)) as tar:
        tar.extractall(bundle, filter="data")
    verify_ledger(decode_ledger((bundle / "ledger.json").read_bytes(), "ledger.json"))
    recomputed = msgspec.to_builtins(compute(bundle))
    assert {**recomputed, "ledger_entries": len(ledger) - 1} == report
    assert report["local_sgd"]["verdict"]["conditions"]


# Bad input ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A backup of a migrated coordinator home with its secret and two blobs."""
    folder = tmp_path_factory.mktemp("backup")
    home = folder / "home"
    home.mkdir()
    migrate.upgrade(sqlite_url(home / "coordinator.sqlite3"))
    for data in (b"first blob", b"second blob"):
        sha256 = hashlib.sha256(data).hexdigest()
        (home / "blobs" / sha256[:2]).mkdir(parents=True, exist_ok=True)
        (home / "blobs" / sha256[:2] / sha256).write_bytes(data)
    (home / "web-secret").write_text(os.urandom(32).hex() + "\n")
    (home / "web-secret").chmod(0o600)
    out = folder / "backup.tar"
    _events(coop_server("backup", "--out", str(out), COOP_HOME=str(home), COOP_DATABASE_URL=""))
    return out


SECOND = hashlib.sha256(b"second blob").hexdigest()


def _rewritten(
    good: Path,
    bad: Path,
    change: Callable[[str, bytes], bytes] = lambda name, data: data,
    drop: str | None = None,
    extra: tarfile.TarInfo | None = None,
) -> Path:
    """``good`` with each member's bytes through ``change`` (keeping their size), less ``drop``, plus ``extra``."""
    with tarfile.open(good) as source, tarfile.open(bad, "w") as target:
        for member in source.getmembers():
            handle = source.extractfile(member)
            assert handle is not None
            if member.name != drop:
                target.addfile(member, io.BytesIO(change(member.name, handle.read())))
        if extra is not None:
            target.addfile(extra, io.BytesIO(b"x" * extra.size))
    return bad


def _extra(name: str, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type = kind
    if kind == tarfile.SYMTYPE:
        member.linkname = "/etc/passwd"
    else:
        member.size = 1
    return member


def _not_a_tar(good: Path, bad: Path) -> Path:
    bad.write_bytes(b"not a tar " * 100)
    return bad


def _tampered_blob(good: Path, bad: Path) -> Path:
    return _rewritten(good, bad, lambda name, data: data.upper() if name.endswith(SECOND) else data)


def _member_outside(good: Path, bad: Path) -> Path:
    return _rewritten(good, bad, extra=_extra("home/../../escaped"))


def _symlink_member(good: Path, bad: Path) -> Path:
    return _rewritten(good, bad, extra=_extra("home/link", tarfile.SYMTYPE))


def _no_manifest(good: Path, bad: Path) -> Path:
    return _rewritten(good, bad, drop="manifest.json")


# How each bad archive is made from a good one, and what the refusal says.
BAD_ARCHIVES: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "not a tar": (_not_a_tar, "is not a tar archive"),
    "tampered blob": (_tampered_blob, f"member home/blobs/{SECOND[:2]}/{SECOND}: its sha256 is"),
    "member outside": (_member_outside, "member 'home/../../escaped' names a path outside the archive"),
    "symlink member": (_symlink_member, "member 'home/link' is a link"),
    "no manifest": (_no_manifest, "holds no manifest.json"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARCHIVES))
def test_a_bad_archive_is_refused_naming_the_member_and_nothing_is_written(
    archive: Path, tmp_path: Path, case: str
) -> None:
    make, message = BAD_ARCHIVES[case]
    bad = make(archive, tmp_path / "bad.tar")
    target = tmp_path / "target"
    before = sorted(tmp_path.iterdir())
    done = coop_server("restore", "--from", str(bad), COOP_HOME=str(target), COOP_DATABASE_URL="")
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert sorted(tmp_path.iterdir()) == before  # no home, no database, no staging folder left beside them
    assert not (tmp_path.parent / "escaped").exists()


def test_a_restore_into_a_home_that_is_not_empty_is_refused_and_changes_nothing(archive: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    done = coop_server("restore", "--from", str(archive), COOP_HOME=str(target), COOP_DATABASE_URL="")
    assert done.returncode == 2 and "is not empty" in done.stderr, done.stderr
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]


def test_a_restore_over_an_existing_database_file_is_refused_and_changes_nothing(archive: Path, tmp_path: Path) -> None:
    existing = tmp_path / "elsewhere.sqlite3"
    existing.write_bytes(b"a database of someone's")
    target = tmp_path / "target"
    done = coop_server("restore", "--from", str(archive), COOP_HOME=str(target), COOP_DATABASE_URL=sqlite_url(existing))
    assert done.returncode == 2 and "never overwrites a database" in done.stderr, done.stderr
    assert existing.read_bytes() == b"a database of someone's" and not target.exists()


def test_a_backup_never_overwrites_its_out_file(archive: Path, tmp_path: Path) -> None:
    out = tmp_path / "backup.tar"
    out.write_bytes(b"an older backup")
    home = archive.parent / "home"
    done = coop_server("backup", "--out", str(out), COOP_HOME=str(home), COOP_DATABASE_URL="")
    assert done.returncode == 2 and "never overwrites" in done.stderr, done.stderr
    assert out.read_bytes() == b"an older backup" and [p.name for p in tmp_path.iterdir()] == ["backup.tar"]
