"""Bearer tokens: created once (the secret is shown once), stored as sha256, looked up by hash."""

from __future__ import annotations

import datetime
import hashlib
import secrets
import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core.errors import CoopError
from server import models
from server.roles import ROLES, Role

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


async def lookup(session: AsyncSession, secret: str) -> Principal | None:
    token = await session.scalar(select(models.Token).where(models.Token.secret_sha256 == digest(secret)))
    if token is None or token.revoked_at is not None:
        return None
    role = next((known for known in ROLES if known == token.role), None)
    if role is None:
        return None  # a role this coordinator does not know grants nothing
    return Principal(token.id, token.name, role)


async def revoke(session: AsyncSession, name: str) -> None:
    token = await session.scalar(select(models.Token).where(models.Token.name == name))
    if token is None:
        raise CoopError(f"no token is named {name!r}")
    token.revoked_at = datetime.datetime.now(datetime.UTC)
