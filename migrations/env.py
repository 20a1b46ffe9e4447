"""Alembic environment: async engine, batch mode on SQLite (ALTER TABLE is limited there)."""

from __future__ import annotations

import asyncio
from typing import Any

from advanced_alchemy.types import GUID
from alembic import context
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Connection
from sqlalchemy.types import TypeEngine

from server import db, models
from server.settings import from_env

config = context.config
target_metadata = models.Experiment.metadata


def _url() -> str:
    # Callers (the CLI, the tests) pass the URL as an attribute; otherwise the environment decides.
    url = config.attributes.get("database_url")
    return str(url) if url else from_env().database_url


def _compare_type(
    migration: MigrationContext,
    inspected_column: Column[Any],
    metadata_column: Column[Any],
    inspected_type: TypeEngine[Any],
    metadata_type: TypeEngine[Any],
) -> bool | None:
    # SQLite reflects GUID's BINARY(16) by its affinity (NUMERIC); that is the same column, not a change.
    if isinstance(metadata_type, GUID) and migration.dialect.name == "sqlite":
        return False
    return None  # alembic's own comparison


def _configure(connection: Connection | None = None, url: str | None = None) -> None:
    context.configure(
        connection=connection,
        url=url,
        target_metadata=target_metadata,
        render_as_batch=db.is_sqlite(_url()),
        compare_type=_compare_type,
        literal_binds=connection is None,
    )


def _run_sync(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # A batch migration rebuilds a SQLite table: it copies the rows and drops the old table, and with foreign
        # keys on that drop would cascade into the rows that refer to it. They are off while migrating, and the
        # references are checked before they are on again.
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()
    if sqlite:
        dangling = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        if dangling:
            raise RuntimeError(f"the migration left rows whose references are missing: {dangling[:5]}")
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")


async def _run_online() -> None:
    engine = db.create_engine(_url())
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    _configure(url=_url())
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_online())
