"""Bearer tokens: created once (the secret is shown once), stored as sha256, looked up by hash."""

from __future__ import annotations

import datetime
import hashlib
import secrets
import uuid
from dataclasses import dataclass

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core.errors import CoopError
from server import models
from server.access.roles import ROLES, Role
from server.dispatch.queue import Caller

PREFIX = "coop_"


@dataclass(frozen=True)
class Principal:
    """Who a request acts as."""

    token_id: uuid.UUID
    name: str
    role: Role


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


async def create(session: AsyncSession, role: str, name: str) -> str:
    """A new token's secret; only its digest is stored, so this is the one time anyone sees it."""
    if role not in ROLES:
        raise CoopError(f"unknown role {role!r}; a token is for one of {', '.join(ROLES)}")
    secret = PREFIX + secrets.token_urlsafe(32)
    session.add(models.Token(name=name, role=role, secret_sha256=digest(secret)))
    try:
        await session.flush()
    except IntegrityError as exc:
        raise CoopError(f"a token named {name!r} already exists; choose another name") from exc
    return secret


# A token by its digest, with the agent registered under it: one Core statement, built once, whose row becomes plain
# records. A request only reads them, and loading them as ORM objects cost more CPU than the query itself.
_tokens, _agents = (models.Token.metadata.tables[name] for name in ("tokens", "agents"))
_BY_DIGEST = (
    select(
        _tokens.c.id,
        _tokens.c.name,
        _tokens.c.role,
        _tokens.c.revoked_at,
        _agents.c.id.label("agent_id"),
        _agents.c.address,
        _agents.c.private_address,
        _agents.c.last_seen_at,
    )
    .select_from(_tokens.outerjoin(_agents, _agents.c.token_id == _tokens.c.id))
    .where(_tokens.c.secret_sha256 == bindparam("digest"))
)


async def lookup(session: AsyncSession, secret: str) -> Principal | None:
    return (await lookup_with_agent(session, secret))[0]


async def lookup_with_agent(session: AsyncSession, secret: str) -> tuple[Principal | None, Caller | None]:
    """Who the secret is (None: unknown, revoked or of a role this coordinator does not know, which grants
    nothing), and the agent registered under its token, if any."""
    row = (await session.execute(_BY_DIGEST, {"digest": digest(secret)})).first()
    if row is None:
        return None, None
    role = next((known for known in ROLES if known == row.role), None)
    if row.revoked_at is not None or role is None:
        return None, None
    agent = None if row.agent_id is None else Caller(row.agent_id, row.address, row.private_address, row.last_seen_at)
    return Principal(row.id, row.name, role), agent


async def revoke(session: AsyncSession, name: str) -> None:
    token = await session.scalar(select(models.Token).where(models.Token.name == name))
    if token is None:
        raise CoopError(f"no token is named {name!r}")
    token.revoked_at = datetime.datetime.now(datetime.UTC)
