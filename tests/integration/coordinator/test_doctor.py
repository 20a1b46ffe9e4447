"""`coop-server doctor`, the coordinator host's preflight, as a real process with the unit's settings (COOP_*) and TLS
files, on SQLite and on Postgres: a host with what the coordinator needs passes; a key others can read, a home on a
mount that a stop erases, or a database that does not answer fails its own check, with its fix and exit 2; and the
doctor makes nothing (no home, no database file, no secret)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from server import db
from tests.support.doctor import run_doctor
from tests.support.tls import Authority, ServerFiles


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> ServerFiles:
    return Authority("coop test CA").issue(tmp_path_factory.mktemp("tls"))


def _doctor(home: Path, database_url: str, *arguments: str) -> tuple[int, dict[str, str], str]:
    env = {**os.environ, "COOP_HOME": str(home), "COOP_DATABASE_URL": database_url}
    return run_doctor("server", list(arguments), env)


def test_a_coordinator_host_with_what_it_needs_passes_and_the_doctor_makes_nothing(
    database_url: str, certificate: ServerFiles, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    tls = ("--certfile", str(certificate.certfile), "--keyfile", str(certificate.keyfile))
    code, lines, out = _doctor(home, database_url, *tls)
    assert code == 0, out
    assert list(lines) == [
        "python", "venv .venv", "home", "coordinator home", "storage", "disk", "key file", "certificate", "database",
    ], out  # fmt: skip
    assert all(line.startswith("ok    ") for line in lines.values()), out
    assert f"{db.describe(database_url)} answers" in lines["database"]
    assert not home.exists()


@pytest.mark.parametrize("migrated_database", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("case", "check", "detail", "fix"),
    [
        ("key open to others", "key file", "is open to users other than", "chmod 600"),
        ("home on an erased mount", "storage", "which a stop of this host erases", "durable (EBS) volume"),
        ("no database", "database", "postgresql+asyncpg://coop:***@127.0.0.1:9/coop", "start the database"),
        ("secret open to others", "home's secret", "is open to users other than", "chmod 600"),
    ],
)
def test_each_thing_wrong_fails_its_check_with_its_fix_and_exit_2(
    database_url: str, certificate: ServerFiles, tmp_path: Path, case: str, check: str, detail: str, fix: str
) -> None:
    home, url = tmp_path / "home", database_url
    keyfile = tmp_path / "coordinator.key"
    keyfile.touch(mode=0o600)
    keyfile.write_bytes(certificate.keyfile.read_bytes())
    extra: tuple[str, ...] = ()
    if case == "key open to others":
        keyfile.chmod(0o644)
    elif case == "home on an erased mount":
        home = Path(f"/dev/shm/coop-doctor-{os.getpid()}")
        extra = ("--ephemeral-mount", "/dev/shm")
    elif case == "no database":
        url = "postgresql+asyncpg://coop:secret@127.0.0.1:9/coop"
    elif case == "secret open to others":
        home.mkdir()
        (home / "web-secret").write_text(os.urandom(32).hex() + "\n")
        (home / "web-secret").chmod(0o640)
    code, lines, out = _doctor(home, url, "--certfile", str(certificate.certfile), "--keyfile", str(keyfile), *extra)
    assert code == 2, out
    assert [name for name, line in lines.items() if line.startswith("FAIL")] == [check], out
    assert detail in lines[check] and fix in lines[check].split("fix: ")[1], out
    assert "secret@" not in out  # the password is not printed
    if case != "secret open to others":
        assert not home.exists()
