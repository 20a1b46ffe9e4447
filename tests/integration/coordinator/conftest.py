"""The coordinator suite runs once on SQLite and once on Postgres.

Postgres is skipped only when no server answers and CI is unset; in CI an unreachable server fails."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from server import migrate
from server.settings import Settings, sqlite_url
from tests.integration.coordinator import support


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "sqlite":
        url = sqlite_url(tmp_path_factory.mktemp("sqlite") / "coordinator.sqlite3")
        migrate.upgrade(url)
        yield url
        return
    admin = support.postgres_admin_url()
    created = support.create_postgres_database(admin)
    if created is None:
        message = f"no Postgres server answers at {admin} (set COOP_TEST_POSTGRES_URL)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        migrate.upgrade(created)
        yield created
    finally:
        support.drop_postgres_database(admin, created)


@pytest.fixture
def make_settings(database_url: str, tmp_path: Path) -> Callable[..., Settings]:
    support.empty_database(database_url)

    def make(**overrides: Any) -> Settings:
        options: dict[str, Any] = {"home": tmp_path, "database_url": database_url, "reap_seconds": 0.1}
        return Settings(**{**options, **overrides})

    return make


@pytest.fixture
def api(make_settings: Callable[..., Settings], database_url: str) -> Iterator[support.Api]:
    settings = make_settings()
    with support.running(settings) as client:
        yield support.Api(client, database_url, settings.home)
