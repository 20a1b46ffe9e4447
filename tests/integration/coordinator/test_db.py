"""The guard's read alone (server.db.read_alone and one_statement), on SQLite and Postgres: a statement in it is
its own transaction, and the session's next transaction, on the same pooled connection, is one transaction again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from server import db, models
from server.settings import Settings

_AUDIT = models.AuditLog.metadata.tables["audit_log"]


def _row(action: str) -> dict[str, object]:
    return {"actor": "test", "action": action, "target": "db", "detail": {}}


async def _actions(session: AsyncSession) -> list[str]:
    return list(await session.scalars(select(_AUDIT.c.action).order_by(_AUDIT.c.action)))


def test_a_read_alone_is_its_own_transaction_and_the_next_is_whole_again(
    make_settings: Callable[..., Settings],
) -> None:
    url = make_settings().database_url

    async def go() -> tuple[list[str], int]:
        engine = db.create_engine(url)  # its pool opens one connection: the one session's, used twice
        try:
            async with db.session_maker(engine)() as session:
                db.one_statement(session, True)
                await db.read_alone(session)
                await session.execute(insert(_AUDIT), _row("alone"))
                await session.rollback()  # too late: the statement was its own transaction
                db.one_statement(session, False)
                await session.execute(insert(_AUDIT), _row("rolled back"))
                await session.rollback()
            # Read through a connection of its own: what the database holds, not what the session saw.
            async with engine.connect() as connection:
                count = (await connection.execute(select(func.count()).select_from(_AUDIT))).scalar_one()
            async with db.session_maker(engine)() as session:
                return await _actions(session), count
        finally:
            await engine.dispose()

    actions, count = asyncio.run(go())
    assert actions == ["alone"] and count == 1
