"""A restore refuses a target that is not empty or an archive that is not whole, writing nothing; a backup never
overwrites its output. (A backup of a live coordinator, restored mid-run, is part of the recorded run of
test_coordinator_kills.py, on SQLite and Postgres.)"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from server import migrate
from server.settings import sqlite_url
from tests.support.processes import coop_server, coop_server_events

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
    coop_server_events("backup", "--out", str(out), COOP_HOME=str(home), COOP_DATABASE_URL="")
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
