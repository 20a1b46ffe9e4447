"""The coordinator's database as the tests reach it directly: throwaway Postgres databases, one committed
transaction at a time, tokens, and a report committed as the coordinator's report job commits it."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import delete, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from server import db, models
from server.access import tokens
from server.settings import Settings

T = TypeVar("T")
DEFAULT_POSTGRES = "postgresql+asyncpg://coop:coop@127.0.0.1:5432/postgres"


def postgres_admin_url() -> str:
    return os.environ.get("COOP_TEST_POSTGRES_URL", DEFAULT_POSTGRES)


async def _admin(url: str, statement: str) -> list[Any]:
    """``statement``'s rows (none for a command), run outside any transaction on a connection of its own."""
    engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as connection:
            result = await connection.execute(text(statement))
            return list(result.all()) if result.returns_rows else []
    finally:
        await engine.dispose()


def create_postgres_database(admin_url: str) -> str | None:
    """A fresh, uniquely named database; None when no server answers."""
    name = f"coop_test_{uuid.uuid4().hex[:12]}"
    try:
        asyncio.run(_admin(admin_url, f'CREATE DATABASE "{name}"'))
    except (OSError, SQLAlchemyError):
        return None
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def drop_postgres_database(admin_url: str, url: str) -> None:
    name = make_url(url).database
    asyncio.run(_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def end_pooled_connections(url: str) -> int:
    """End every other connection to the Postgres database of ``url`` from the server's side, as a restart or an
    idle timeout does, but a coordinator's listener for claimable jobs (whose reconnect would wake a background
    round); how many ended."""
    ended = asyncio.run(
        _admin(
            url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND query NOT LIKE 'LISTEN%'",
        )
    )
    return sum(1 for (done,) in ended if done)


def with_session(url: str, work: Callable[[AsyncSession], Awaitable[T]]) -> T:
    """Run ``work`` in one committed transaction on a short-lived engine."""

    async def go() -> T:
        engine = db.create_engine(url)
        try:
            async with db.session_maker(engine)() as session, session.begin():
                return await work(session)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def empty_database(url: str) -> None:
    async def wipe(session: AsyncSession) -> None:
        for table in reversed(models.Experiment.metadata.sorted_tables):
            await session.execute(delete(table))

    with_session(url, wipe)


def make_token(url: str, role: str, name: str) -> str:
    async def create(session: AsyncSession) -> str:
        return await tokens.create(session, role, name)

    return with_session(url, create)


def record_report(database_url: str, home: Path, experiment_id: str, report: dict[str, Any]) -> str:
    """Commit ``report`` as the coordinator's report job does (server.reporter), for tests of what a recorded
    report looks like; over HTTP an operator can only ask the coordinator to compute one."""
    from server.protocol import phases, recording

    async def record(session: AsyncSession) -> str:
        experiment = await recording.load(session, uuid.UUID(experiment_id), lock=True)
        settings = Settings(home=home, database_url=database_url)
        identity = await recording.store_and_commit_report(session, settings, experiment, report)
        await phases.progress(session, settings, experiment)
        return identity

    return with_session(database_url, record)
