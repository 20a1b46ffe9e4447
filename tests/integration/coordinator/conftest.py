"""The coordinator suite runs once on SQLite (a fresh copy of one migrated file for each test) and once on Postgres
(one database, emptied before each test).

Postgres is skipped only when no server answers and CI is unset; in CI an unreachable server fails."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from server import db, migrate
from server.settings import Settings, sqlite_url
from tests.integration.coordinator import support
from tests.support import database


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def migrated_database(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The session's migrated database: a SQLite file (copied for each test) or a Postgres database (emptied)."""
    if request.param == "sqlite":
        url = sqlite_url(tmp_path_factory.mktemp("sqlite") / "coordinator.sqlite3")
        migrate.upgrade(url)
        yield url
        return
    admin = database.postgres_admin_url()
    created = database.create_postgres_database(admin)
    if created is None:
        pytest.fail(
            f"no Postgres server answers at {admin}: run `make services` (as root), or set COOP_TEST_POSTGRES_URL"
        )
    try:
        migrate.upgrade(created)
        yield created
    finally:
        database.drop_postgres_database(admin, created)


@pytest.fixture
def database_url(migrated_database: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """On SQLite, a copy of the migrated file for this test alone, so that nothing a test leaves behind (a
    connection an app stopped in-process did not close, holding the write lock) reaches the next; on Postgres, the
    session's database."""
    if not db.is_sqlite(migrated_database):
        return migrated_database
    copy = tmp_path_factory.mktemp("sqlite") / "coordinator.sqlite3"
    source = make_url(migrated_database).database or ""
    with contextlib.closing(sqlite3.connect(source)) as template, contextlib.closing(sqlite3.connect(copy)) as target:
        template.backup(target)
    return sqlite_url(copy)


@pytest.fixture
def make_settings(database_url: str, tmp_path: Path) -> Callable[..., Settings]:
    database.empty_database(database_url)

    def make(**overrides: Any) -> Settings:
        options: dict[str, Any] = {"home": tmp_path, "database_url": database_url, "reap_seconds": 0.1}
        return Settings(**{**options, **overrides})

    return make


@pytest.fixture
def api(make_settings: Callable[..., Settings], database_url: str) -> Iterator[support.Api]:
    settings = make_settings()
    with support.running(settings) as client:
        yield support.Api(client, database_url, settings.home)
