"""The web UI's sessions as rows of ``web_sessions``: begun at sign-in, read with their token on every request of a
signed-in browser, ended at sign-out (server.web.gate decides who a row signs in)."""

from __future__ import annotations

import datetime
import uuid
from typing import NamedTuple

from sqlalchemy import bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from server import models


class Standing(NamedTuple):
    """A session row and its token, as the gate checks them."""

    expires_at: datetime.datetime
    ended_at: datetime.datetime | None
    token_id: uuid.UUID
    name: str
    role: str
    revoked_at: datetime.datetime | None


# A session and its token, read by one Core statement on every request of a signed-in browser.
_sessions, _tokens = (models.WebSession.metadata.tables[name] for name in ("web_sessions", "tokens"))
_SESSION = (
    select(
        _sessions.c.expires_at,
        _sessions.c.ended_at,
        _tokens.c.id.label("token_id"),
        _tokens.c.name,
        _tokens.c.role,
        _tokens.c.revoked_at,
    )
    .select_from(_sessions.join(_tokens, _tokens.c.id == _sessions.c.token_id))
    .where(_sessions.c.id == bindparam("session_id"))
)


async def standing(session: AsyncSession, session_id: uuid.UUID) -> Standing | None:
    row = (await session.execute(_SESSION, {"session_id": session_id})).first()
    return None if row is None else Standing(*row)


async def begin(session: AsyncSession, token_id: uuid.UUID, expires_at: datetime.datetime) -> uuid.UUID:
    """A new session of the token's, until ``expires_at``; its id."""
    row = models.WebSession(token_id=token_id, expires_at=expires_at)
    session.add(row)
    await session.flush()
    return row.id


async def end(session: AsyncSession, session_id: uuid.UUID, now: datetime.datetime) -> None:
    """End the session (one already ended keeps its first end)."""
    await session.execute(
        update(models.WebSession)
        .where(models.WebSession.id == session_id, models.WebSession.ended_at.is_(None))
        .values(ended_at=now)
    )
