"""Migrations build the schema from empty, match the models exactly, and come down again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from server import migrate
from server.settings import sqlite_url
from tests.support import database


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield sqlite_url(tmp_path / "empty.sqlite3")
        return
    admin = database.postgres_admin_url()
    url = database.create_postgres_database(admin)
    if url is None:
        pytest.fail(f"no Postgres server answers at {admin}: run `make services` (as root)")
    try:
        yield url
    finally:
        database.drop_postgres_database(admin, url)


def test_migrations_from_empty_match_the_models_and_downgrade(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    migrate.check(empty_url)  # raises when autogenerate would find a difference
    migrate.downgrade(empty_url, "base")
    migrate.upgrade(empty_url)
    migrate.check(empty_url)
