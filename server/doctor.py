"""``coop-server doctor``: the coordinator host's preflight, run by the operator first and by the unit before each
start (``ExecStartPre``), with the unit's own settings (COOP_* variables) and TLS files. One line a check; a failure
prints its fix, and any failure exits 2. It changes nothing: it creates no home, no database and no secret."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from experiment.core import hostchecks, mounts, secretfile
from experiment.core.errors import CoopError
from experiment.core.hostchecks import Finding, failed, passed
from server import db
from server.access import secret, tls
from server.settings import Settings

SETUP = "make setup-coordinator (docs/operating.md, Install)"
MIN_FREE_BYTES = 2**30  # a floor for the database and the blob store, which a run fills by megabytes


def findings(
    settings: Settings, certfile: Path | None, keyfile: Path | None, ephemeral: tuple[Path, ...]
) -> Iterator[Finding]:
    yield hostchecks.python()
    yield hostchecks.venv(Path(sys.prefix), SETUP)
    yield hostchecks.home(os.environ)
    yield _coordinator_home(settings.home)
    durable = {"coordinator home": settings.home}
    if db.is_sqlite(settings.database_url):
        folder = Path(settings.database_url.split("///", 1)[1]).parent
        if folder.resolve() != settings.home.resolve():
            durable["database folder"] = folder
    yield hostchecks.durable(durable, (*mounts.KNOWN_EPHEMERAL, *ephemeral), mounts.read())
    yield hostchecks.disk(settings.home, MIN_FREE_BYTES, "the coordinator's floor")
    if (settings.home / secret.FILE).exists():
        yield hostchecks.secret(settings.home / secret.FILE, "home's secret")
    if certfile is not None and keyfile is not None:
        key = hostchecks.secret(keyfile, "key file")
        yield key
        if key.passed:  # else the certificate's check would fail on the same file again
            yield _certificate(certfile, keyfile)
    yield _database(settings.database_url)


def _coordinator_home(home: Path) -> Finding:
    check = "coordinator home"
    fix = f"as root: install -d -o {secretfile.user_name(os.geteuid())} -m 700 {home}"
    if home.exists():
        if not home.is_dir() or not os.access(home, os.W_OK | os.X_OK):
            return failed(check, f"COOP_HOME {home} is not a folder this user can write", fix)
        return passed(check, f"COOP_HOME {home} is writable")
    parent = hostchecks.existing(home)
    if not os.access(parent, os.W_OK | os.X_OK):
        return failed(check, f"COOP_HOME {home} does not exist and this user cannot make it in {parent}", fix)
    return passed(check, f"COOP_HOME {home} will be made in {parent}")


def _certificate(certfile: Path, keyfile: Path) -> Finding:
    try:
        tls.check(certfile, keyfile)
    except CoopError as exc:
        return failed("certificate", str(exc), "issue the certificate again (docs/operating.md, Certificates)")
    return passed("certificate", f"{certfile} and its key serve TLS")


def _database(url: str) -> Finding:
    check = "database"
    described = db.describe(url)
    if db.is_sqlite(url):
        path = Path(url.split("///", 1)[1])
        if not path.exists():
            return passed(check, f"{described} will be made by coop-server migrate")

    async def ping() -> None:
        engine = db.create_engine(url)
        try:
            async with engine.connect() as connection:
                await connection.execute(text("SELECT 1"))
        finally:
            await engine.dispose()

    try:
        asyncio.run(asyncio.wait_for(ping(), 15))
    except (CoopError, OSError, TimeoutError, SQLAlchemyError) as exc:
        return failed(check, f"{described}: {exc}", "start the database, or correct COOP_DATABASE_URL")
    return passed(check, f"{described} answers")
