"""Backups that restore: ``coop-server backup`` writes one tar while the coordinator runs (a manifest, a consistent
snapshot of the database, the home's secret and the blob store's files), and ``coop-server restore`` checks every
byte of one against its manifest before it places anything into an empty home (and, on Postgres, an empty
database)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import hashlib
import io
import os
import re
import shutil
import sqlite3
import subprocess
import tarfile
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Annotated, Literal

import msgspec
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import String, column, func, select, table, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from experiment.core.canonical import canonical_bytes, fsync_path, sha256_file
from experiment.core.errors import CoopError
from experiment.core.plan import Sha256
from experiment.core.progress import Emit
from server import db, migrate, models
from server.access import secret
from server.settings import Settings, sqlite_url
from server.store import blobstore

FORMAT = 1
MANIFEST = "manifest.json"
Dialect = Literal["sqlite", "postgresql"]
DATABASE: dict[Dialect, str] = {"sqlite": "database/coordinator.sqlite3", "postgresql": "database/coordinator.pgdump"}
# Members under home/ go to the same path under COOP_HOME. Of the home a restored coordinator needs, besides the
# database, its secret (the web UI's keys and the probes' serving tokens derive from it) and the blob store. Not
# reports/ (each report attempt's work folder, rebuilt from the stored evidence by the next attempt; the reports
# themselves are blobs) and not blobs/.incoming (uploads in flight: a blob is stored only once its file is linked).
HOME = "home"
SECRET = f"{HOME}/{secret.FILE}"
BLOB = re.compile(rf"{HOME}/blobs/([0-9a-f]{{2}})/(\1[0-9a-f]{{62}})")
BLOCK = 1 << 20
PROGRESS_EVERY = 64  # files between two progress events


class ArchivedFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    path: str  # the member's name in the tar
    sha256: Sha256
    size: Annotated[int, msgspec.Meta(ge=0)]


class Manifest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The archive's first member: what the rest holds, each file with its sha256."""

    format: int
    created_at: str
    dialect: Dialect
    revision: str  # the database's alembic revision
    counts: dict[str, int]  # rows of each table in the snapshot
    blobs: int  # blob files archived
    files: list[ArchivedFile]  # every other member, in the archive's order


@dataclass(frozen=True)
class Snapshot:
    """What a database snapshot holds, read in the snapshot itself."""

    revision: str
    counts: dict[str, int]
    blob_rows: frozenset[str]


def dialect_of(url: str) -> Dialect:
    if url.startswith("sqlite+aiosqlite"):
        return "sqlite"
    if url.startswith("postgresql+asyncpg"):
        return "postgresql"
    raise CoopError(f"unsupported database URL {url!r}: use sqlite+aiosqlite:///PATH or postgresql+asyncpg://...")


# The database ----------------------------------------------------------------------------------------------------


async def _describe(connection: AsyncConnection) -> Snapshot:
    if connection.dialect.name == "sqlite":
        listing = "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
    else:
        listing = (
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'"
        )
    tables = sorted(str(name) for name in (await connection.execute(text(listing))).scalars())
    if "alembic_version" not in tables:
        raise CoopError("the database has no alembic revision: it was never migrated (coop-server migrate)")
    counts = {
        name: int((await connection.execute(select(func.count()).select_from(table(name)))).scalar_one())
        for name in tables
    }
    versions = await connection.execute(select(column("version_num", String)).select_from(table("alembic_version")))
    revisions = [str(version) for version in versions.scalars()]
    if len(revisions) != 1:
        raise CoopError(f"the database records {len(revisions)} alembic revisions, not one")
    rows = frozenset(str(sha) for sha in (await connection.execute(select(models.Blob.sha256))).scalars())
    return Snapshot(revisions[0], counts, rows)


async def _describe_sqlite(path: Path) -> Snapshot:
    # A plain engine: the coordinator's (server.db) would switch the file to WAL on connect.
    engine = create_async_engine(sqlite_url(path))
    try:
        async with engine.connect() as connection:
            return await _describe(connection)
    finally:
        await engine.dispose()


def _sqlite_file(url: str) -> Path:
    database = make_url(url).database
    if not database or database == ":memory:":
        raise CoopError(f"COOP_DATABASE_URL {url!r} names no SQLite file")
    return Path(database)


def _snapshot_sqlite(url: str, target: Path) -> Snapshot:
    source = _sqlite_file(url)
    if not source.is_file():
        raise CoopError(f"there is no database at {source}: do COOP_HOME and COOP_DATABASE_URL name the coordinator's?")
    # mode=rw: never create a database that is not there.
    live_uri = f"file:{urllib.parse.quote(str(source.resolve()))}?mode=rw"
    try:
        with (
            contextlib.closing(sqlite3.connect(live_uri, uri=True, timeout=db.SQLITE_BUSY_TIMEOUT_MS / 1000)) as live,
            contextlib.closing(sqlite3.connect(target)) as copy,
        ):
            # SQLite's online backup in one step: one read transaction, so one consistent snapshot while the
            # coordinator writes beside it (WAL).
            live.backup(copy)
            copy.execute("PRAGMA journal_mode=DELETE")  # one self-contained file; the coordinator sets WAL again
            (check,) = copy.execute("PRAGMA quick_check").fetchone()
    except sqlite3.Error as exc:
        raise CoopError(f"cannot copy the database {source}: {exc}") from exc
    if check != "ok":
        raise CoopError(f"the copy of {source} fails SQLite's quick_check: {check}")
    return asyncio.run(_describe_sqlite(target))


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise CoopError(
            f"{name} is not installed here: a Postgres backup and restore run PostgreSQL's client tools "
            "(Debian: apt install postgresql-client, of the server's major version or newer)"
        )
    return found


def _libpq(url: str) -> tuple[str, dict[str, str]]:
    """The libpq URL of a SQLAlchemy one, and its password as PGPASSWORD (never on a command line, which ``ps``
    shows)."""
    parsed = make_url(url)
    query = dict(parsed.query)
    if "ssl" in query:  # asyncpg's name for libpq's sslmode
        query["sslmode"] = query.pop("ssl")
    plain = parsed.set(drivername="postgresql", password=None, query=query)
    return plain.render_as_string(hide_password=False), {} if parsed.password is None else {
        "PGPASSWORD": parsed.password
    }


def _run_tool(argv: list[str], password: dict[str, str]) -> str:
    done = subprocess.run(argv, env={**os.environ, **password}, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise CoopError(f"{Path(argv[0]).name} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


async def _snapshot_postgres(url: str, target: Path) -> Snapshot:
    pg_dump = _tool("pg_dump")
    libpq, password = _libpq(url)
    engine = db.create_engine(url)
    try:
        async with engine.connect() as connection:
            await connection.execution_options(isolation_level="REPEATABLE READ")
            async with connection.begin():
                # pg_dump reads the snapshot this transaction exports, so the manifest's revision and counts are
                # those of the dump itself.
                exported = (await connection.execute(text("SELECT pg_export_snapshot()"))).scalar_one()
                snapshot = await _describe(connection)
                argv = [pg_dump, "--format=custom", f"--snapshot={exported}", "--no-password", f"--file={target}"]
                _run_tool([*argv, f"--dbname={libpq}"], password)
    except (OSError, SQLAlchemyError) as exc:
        raise CoopError(f"cannot read the database {db.describe(url)}: {exc}") from exc
    finally:
        await engine.dispose()
    return snapshot


# The archive ------------------------------------------------------------------------------------------------------


def _blob_member(sha256: str) -> str:
    return f"{HOME}/blobs/{sha256[:2]}/{sha256}"


def _blob_files(settings: Settings, emit: Emit) -> list[Path]:
    """Every blob's file in the store, by name; what else is there (uploads in flight) is left out."""
    found: list[Path] = []
    if not settings.blob_dir.is_dir():
        return found
    for folder in sorted(settings.blob_dir.iterdir()):
        if folder.name == blobstore.INCOMING:
            continue
        paths = sorted(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else [folder]
        for path in paths:
            if BLOB.fullmatch(f"{HOME}/blobs/{folder.name}/{path.name}") and path.is_file() and not path.is_symlink():
                found.append(path)
            else:
                emit({"event": "skipped", "path": str(path), "why": "not a blob's file"})
    return found


class _Hashing:
    """A reader that hashes what it reads (tarfile copies a member's bytes through it)."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.digest.update(data)
        return data


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o600, int(time.time())
    return info


def _add(tar: tarfile.TarFile, entry: ArchivedFile, source: Path) -> None:
    with source.open("rb") as handle:
        reading = _Hashing(handle)
        tar.addfile(_member(entry.path, entry.size), reading)
    if reading.digest.hexdigest() != entry.sha256:
        what = "a blob's file must hash to its name" if BLOB.fullmatch(entry.path) else "it changed while copied"
        raise CoopError(f"{source}: its sha256 is {reading.digest.hexdigest()}, not {entry.sha256} ({what})")


def _write(partial: Path, manifest: Manifest, sources: dict[str, Path], emit: Emit) -> None:
    """The tar: the manifest first, then every file it lists, each checked against its sha256 as it is copied."""
    try:
        # Mode 0600: the archive holds the home's secret and the tokens' hashes.
        with (
            open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle,
            tarfile.open(fileobj=handle, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            encoded = canonical_bytes(msgspec.to_builtins(manifest)) + b"\n"
            tar.addfile(_member(MANIFEST, len(encoded)), io.BytesIO(encoded))
            for done, entry in enumerate(manifest.files, 1):
                _add(tar, entry, sources[entry.path])
                if done % PROGRESS_EVERY == 0 or done == len(manifest.files):
                    emit({"event": "files", "done": done, "total": len(manifest.files)})
        fsync_path(partial)
    except OSError as exc:
        raise CoopError(f"cannot write the backup: {exc}") from None


def backup(settings: Settings, out: Path, emit: Emit) -> Manifest:
    """Write the coordinator's backup to ``out``, which must not exist (a backup never overwrites a file)."""
    if out.exists() or out.is_symlink():
        raise CoopError(f"{out} already exists; a backup never overwrites a file: choose another --out")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK | os.X_OK):
        raise CoopError(f"cannot write {out}: {out.parent} is not a folder this user may write into")
    dialect = dialect_of(settings.database_url)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as work:
        staged = Path(work) / "database"
        # The database first: a blob's file is linked into the store (fsynced) before its row is written, so every
        # row of this snapshot has its file by the time the store is read; files newer than the snapshot are
        # harmless.
        if dialect == "sqlite":
            snapshot = _snapshot_sqlite(settings.database_url, staged)
        else:
            snapshot = asyncio.run(_snapshot_postgres(settings.database_url, staged))
        emit({"event": "database", "dialect": dialect, "revision": snapshot.revision, "bytes": staged.stat().st_size})
        stored = _blob_files(settings, emit)
        missing = sorted(snapshot.blob_rows - {path.name for path in stored})
        if missing:
            raise CoopError(
                f"{len(missing)} blob(s) recorded in the database have no file in {settings.blob_dir} "
                f"(first: {missing[0]}); a backup without them would not restore"
            )
        sources = {DATABASE[dialect]: staged}
        if (settings.home / secret.FILE).is_file():
            sources[SECRET] = settings.home / secret.FILE
        files = [ArchivedFile(name, sha256_file(path), path.stat().st_size) for name, path in sources.items()]
        for path in stored:
            sources[_blob_member(path.name)] = path
            files.append(ArchivedFile(_blob_member(path.name), path.name, path.stat().st_size))
        manifest = Manifest(
            format=FORMAT,
            created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            dialect=dialect,
            revision=snapshot.revision,
            counts=snapshot.counts,
            blobs=len(stored),
            files=files,
        )
        partial = Path(work) / "backup.tar"
        _write(partial, manifest, sources, emit)
        try:
            os.link(partial, out)  # never replaces: fails if ``out`` appeared meanwhile
        except FileExistsError:
            raise CoopError(f"{out} already exists; a backup never overwrites a file: choose another --out") from None
        fsync_path(out.parent)
    emit(
        {
            "event": "backed-up",
            "out": str(out),
            "bytes": out.stat().st_size,
            "dialect": dialect,
            "revision": manifest.revision,
            "blobs": manifest.blobs,
        }
    )
    return manifest


# Restore ----------------------------------------------------------------------------------------------------------


def _check_empty_home(home: Path) -> None:
    if home.is_symlink() or (home.exists() and not home.is_dir()):
        raise CoopError(f"COOP_HOME {home} is not a folder; a restore goes into an empty or new folder")
    if home.is_dir() and any(home.iterdir()):
        raise CoopError(
            f"COOP_HOME {home} is not empty; a restore never mixes a backup with what is there: name a new COOP_HOME"
        )


def _check_no_sqlite(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        existing = path.with_name(path.name + suffix)
        if existing.exists() or existing.is_symlink():
            raise CoopError(f"{existing} already exists; a restore never overwrites a database: name a new one")


async def _check_empty_postgres(url: str) -> None:
    engine = db.create_engine(url)
    try:
        async with engine.connect() as connection:
            listing = (
                "SELECT table_schema || '.' || table_name FROM information_schema.tables "
                "WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1"
            )
            tables = list((await connection.execute(text(listing))).scalars())
    except (OSError, SQLAlchemyError) as exc:
        raise CoopError(f"cannot reach the database {db.describe(url)}: {exc}") from exc
    finally:
        await engine.dispose()
    if tables:
        raise CoopError(
            f"the database {db.describe(url)} is not empty ({len(tables)} tables, e.g. {tables[0]}); a restore goes "
            "into an empty database only: create a new one (CREATE DATABASE) and name it in COOP_DATABASE_URL"
        )


def _open_archive(source: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(source, "r:")
    except FileNotFoundError:
        raise CoopError(f"{source} does not exist") from None
    except tarfile.TarError:
        raise CoopError(f"{source} is not a tar archive, so not a coop-server backup") from None
    except OSError as exc:
        raise CoopError(f"cannot read {source}: {exc.strerror}") from None


def _members(source: Path, tar: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """Every member by name, once each, plain files only, inside the archive's folder."""
    try:
        listed = tar.getmembers()
    except (tarfile.TarError, OSError) as exc:
        raise CoopError(f"{source} is not a whole tar archive: {exc}") from None
    members: dict[str, tarfile.TarInfo] = {}
    for member in listed:
        name = PurePosixPath(member.name)
        if name.is_absolute() or ".." in name.parts or str(name) != member.name:
            raise CoopError(f"{source}: member {member.name!r} names a path outside the archive; refused")
        if not member.isfile():
            kind = "link" if member.issym() or member.islnk() else "folder" if member.isdir() else "special file"
            raise CoopError(f"{source}: member {member.name!r} is a {kind}; a backup holds plain files only")
        if member.name in members:
            raise CoopError(f"{source}: member {member.name!r} appears twice")
        members[member.name] = member
    return members


def _read_manifest(source: Path, tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo]) -> Manifest:
    if MANIFEST not in members:
        raise CoopError(f"{source} holds no {MANIFEST}: it is not a coop-server backup")
    try:
        handle = tar.extractfile(members[MANIFEST])
        assert handle is not None  # a plain file (_members)
        manifest = msgspec.json.decode(handle.read(), type=Manifest)
    except (tarfile.TarError, OSError) as exc:
        raise CoopError(f"{source}: member {MANIFEST} cannot be read: {exc}") from None
    except msgspec.DecodeError as exc:
        raise CoopError(f"{source}: member {MANIFEST}: {exc}") from None
    if manifest.format != FORMAT:
        raise CoopError(f"{source}: member {MANIFEST}: format {manifest.format}; this coordinator reads {FORMAT}")
    return manifest


def _check_listing(source: Path, manifest: Manifest, members: dict[str, tarfile.TarInfo], dialect: Dialect) -> None:
    """The manifest names every other member, each once, each a database, the secret or a blob named by its
    sha256; a mismatch names the member."""
    if manifest.dialect != dialect:
        raise CoopError(
            f"{source} is a backup of a {manifest.dialect} database and COOP_DATABASE_URL names a {dialect} one; "
            "restore it into the same kind"
        )
    listed = {entry.path: entry for entry in manifest.files}
    if len(listed) != len(manifest.files):
        raise CoopError(f"{source}: member {MANIFEST}: a file is listed twice")
    for name in members:
        if name != MANIFEST and name not in listed:
            raise CoopError(f"{source}: member {name!r} is not in the manifest")
    for entry in manifest.files:
        blob = BLOB.fullmatch(entry.path)
        if entry.path not in {DATABASE[dialect], SECRET} and blob is None:
            raise CoopError(f"{source}: member {entry.path!r} is not a part of a backup (database, secret or blob)")
        if blob is not None and blob.group(2) != entry.sha256:
            raise CoopError(f"{source}: member {entry.path}: the manifest's sha256 {entry.sha256} is not its name")
        if entry.path not in members:
            raise CoopError(f"{source}: member {entry.path} is in the manifest but not in the archive")
        if members[entry.path].size != entry.size:
            raise CoopError(
                f"{source}: member {entry.path} holds {members[entry.path].size} bytes, the manifest says {entry.size}"
            )
    if DATABASE[dialect] not in listed:
        raise CoopError(f"{source}: member {DATABASE[dialect]} (the database) is missing")
    if sum(1 for entry in manifest.files if BLOB.fullmatch(entry.path)) != manifest.blobs:
        raise CoopError(f"{source}: member {MANIFEST}: it counts {manifest.blobs} blobs and lists another number")


def _migrations(url: str) -> ScriptDirectory:
    return ScriptDirectory.from_config(migrate.alembic_config(url))


def _check_revision(source: Path, manifest: Manifest, url: str) -> None:
    try:
        _migrations(url).get_revision(manifest.revision)
    except CommandError:
        raise CoopError(
            f"{source}: its database is at revision {manifest.revision}, which this coordinator's migrations do not "
            "know: restore it with the coop version that made it, or a newer one"
        ) from None


def _extract(source: Path, tar: tarfile.TarFile, member: tarfile.TarInfo, entry: ArchivedFile, target: Path) -> None:
    """The member's bytes into ``target`` (a new file, mode 0600), refused unless they hash to the manifest's."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        handle = tar.extractfile(member)
        assert handle is not None  # a plain file (_members)
        with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            for block in iter(lambda: handle.read(BLOCK), b""):
                digest.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
    except tarfile.TarError as exc:
        raise CoopError(f"{source}: member {entry.path} cannot be read: {exc}") from None
    except OSError as exc:
        raise CoopError(f"{source}: member {entry.path} cannot be restored to {target}: {exc}") from None
    if digest.hexdigest() != entry.sha256:
        what = "a blob's bytes must hash to its name" if BLOB.fullmatch(entry.path) else "it was changed"
        raise CoopError(
            f"{source}: member {entry.path}: its sha256 is {digest.hexdigest()}, not the manifest's {entry.sha256} "
            f"({what})"
        )


def _check_restored(source: Path, manifest: Manifest, restored: Snapshot, where: str) -> None:
    """The restored database is the manifest's: its revision, its rows per table, and every blob it records is in
    the archive."""
    if restored.revision != manifest.revision:
        raise CoopError(f"{source}: {where} is at revision {restored.revision}, the manifest says {manifest.revision}")
    if restored.counts != manifest.counts:
        differ = sorted(
            name
            for name in manifest.counts.keys() | restored.counts.keys()
            if manifest.counts.get(name) != restored.counts.get(name)
        )
        raise CoopError(
            f"{source}: {where} holds {restored.counts.get(differ[0], 0)} rows of {differ[0]}, the manifest says "
            f"{manifest.counts.get(differ[0], 0)}"
        )
    archived = {entry.sha256 for entry in manifest.files if BLOB.fullmatch(entry.path)}
    missing = sorted(restored.blob_rows - archived)
    if missing:
        raise CoopError(f"{source}: {where} records blob {missing[0]}, which the archive lacks")


def _place_new(staged: Path, target: Path) -> None:
    """Link ``staged`` in as ``target``, which is never replaced; across file systems, through a copy beside it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(staged, target)
    except FileExistsError:
        raise CoopError(f"{target} appeared during the restore; it is never overwritten") from None
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as work:
            copy = Path(work) / target.name
            shutil.copyfile(staged, copy)
            fsync_path(copy)
            _place_new(copy, target)
    fsync_path(target.parent)


def _nearest_folder(path: Path) -> Path:
    while not path.is_dir() and path != path.parent:
        path = path.parent
    if not os.access(path, os.W_OK | os.X_OK):
        raise CoopError(f"cannot restore into {path}: this user may not write there")
    return path


def restore(settings: Settings, source: Path, emit: Emit) -> Manifest:
    """Restore the backup ``source`` into the empty home (and empty database) the settings name. Everything is
    checked before anything is placed: the target is empty, the archive's members are plain files listed in its
    manifest, and each hashes to the manifest's sha256 (a blob's to its name)."""
    url, home = settings.database_url, settings.home
    dialect = dialect_of(url)
    _check_empty_home(home)
    if dialect == "sqlite":
        _check_no_sqlite(_sqlite_file(url))
    else:
        _tool("pg_restore")
        asyncio.run(_check_empty_postgres(url))
    with _open_archive(source) as tar:
        members = _members(source, tar)
        manifest = _read_manifest(source, tar, members)
        _check_listing(source, manifest, members, dialect)
        _check_revision(source, manifest, url)
        # Staged in the home itself when it exists (empty), else beside where it will be: the same file system, so
        # that placing is a rename. A refusal removes the staging folder and leaves the home as it was.
        with tempfile.TemporaryDirectory(dir=_nearest_folder(home), prefix=f".{home.name}.restore-") as work:
            staging = Path(work)
            for done, entry in enumerate(manifest.files, 1):
                _extract(source, tar, members[entry.path], entry, staging / entry.path)
                if done % PROGRESS_EVERY == 0 or done == len(manifest.files):
                    emit({"event": "verified", "done": done, "total": len(manifest.files)})
            database = staging / DATABASE[dialect]
            if dialect == "sqlite":
                _check_restored(source, manifest, asyncio.run(_describe_sqlite(database)), DATABASE[dialect])
                _place_new(database, _sqlite_file(url))
            else:
                _restore_postgres(source, manifest, url, database)
            emit({"event": "database", "dialect": dialect, "revision": manifest.revision, "to": db.describe(url)})
            home.mkdir(parents=True, exist_ok=True)
            if (staging / HOME).is_dir():
                for part in sorted((staging / HOME).iterdir()):
                    os.rename(part, home / part.name)
            fsync_path(home)
    # As the coordinator's start does (coop-server migrate, serve --migrate): the schema of this code.
    migrate.upgrade(url)
    emit(
        {
            "event": "restored",
            "home": str(home),
            "database": db.describe(url),
            "blobs": manifest.blobs,
            "revision": manifest.revision,
            "head": _migrations(url).get_current_head(),
        }
    )
    return manifest


def _restore_postgres(source: Path, manifest: Manifest, url: str, dump: Path) -> None:
    pg_restore = _tool("pg_restore")
    libpq, password = _libpq(url)
    try:
        _run_tool([pg_restore, "--list", str(dump)], password)  # a dump this pg_restore reads, before any write
    except CoopError as exc:
        raise CoopError(f"{source}: member {DATABASE['postgresql']}: {exc}") from None
    # One transaction: a failure leaves the database as empty as it was.
    argv = [pg_restore, "--no-owner", "--single-transaction", "--exit-on-error", "--no-password"]
    _run_tool([*argv, f"--dbname={libpq}", str(dump)], password)

    async def describe() -> Snapshot:
        engine = db.create_engine(url)
        try:
            async with engine.connect() as connection:
                return await _describe(connection)
        finally:
            await engine.dispose()

    try:
        _check_restored(source, manifest, asyncio.run(describe()), db.describe(url))
    except CoopError as exc:
        raise CoopError(
            f"{exc}; the database was restored all the same: drop its tables before you try again"
        ) from None
