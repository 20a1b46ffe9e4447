"""Who may do what: reads are public unless switched off; writes need a bearer token of the handler's role.

A handler declares its role in ``opt={"role": ...}`` (a role, or a tuple of roles); the app-wide guard
resolves the token, checks the role and leaves the principal on the connection for the ``principal`` and
``agent`` dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from advanced_alchemy.extensions.litestar import SQLAlchemyAsyncConfig
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from server import models, tokens
from server.errors import Forbidden, Unauthenticated
from server.lifecycle import Refused
from server.settings import Settings
from server.tokens import Principal

STATE_KEY = "coop"


@dataclass(frozen=True)
class Context:
    """What the app keeps in ``app.state``: its settings, a session maker for work outside a request, and
    the plugin's config, whose ``provide_session`` gives the guard the request's own session."""

    settings: Settings
    sessions: async_sessionmaker[AsyncSession]
    database: SQLAlchemyAsyncConfig


def context(connection: ASGIConnection) -> Context:  # type: ignore[type-arg]
    value = connection.app.state[STATE_KEY]
    assert isinstance(value, Context)
    return value


def _bearer(connection: ASGIConnection) -> str | None:  # type: ignore[type-arg]
    header = connection.headers.get("authorization")
    if header is None:
        return None
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <token>'")
    return secret.strip()


async def authorize(connection: ASGIConnection, handler: BaseRouteHandler) -> None:  # type: ignore[type-arg]
    if handler.opt.get("web"):
        return  # the web UI's pages and assets: server.web checks their session cookie, never a bearer token
    ctx = context(connection)
    role = handler.opt.get("role")
    if role is None and (ctx.settings.public_read or connection.url.path.startswith("/schema")):
        return
    secret = _bearer(connection)
    if secret is None:
        raise Unauthenticated("this request needs a bearer token (Authorization: Bearer <token>)")
    # The token is looked up in the session (and transaction) the handler then uses: one connection and,
    # on SQLite, one write-lock turn per request instead of two (claims were queueing twice for the lock).
    principal = await tokens.lookup(ctx.database.provide_session(connection.app.state, connection.scope), secret)
    if principal is None:
        raise Unauthenticated("the bearer token is unknown or revoked")
    roles = (role,) if isinstance(role, str) else tuple(role or ())
    if roles and principal.role not in roles:
        raise Forbidden(
            f"this request needs an {' or '.join(roles)} token; {principal.name!r} is an {principal.role} token"
        )
    connection.state.principal = principal


def provide_principal(request: Request[Any, Any, Any]) -> Principal:
    principal = request.state.get("principal")
    if not isinstance(principal, Principal):
        raise Unauthenticated("this request needs a bearer token (Authorization: Bearer <token>)")
    return principal


async def provide_agent(
    principal: NamedDependency[Principal], db_session: NamedDependency[AsyncSession]
) -> models.Agent:
    agent = await db_session.scalar(select(models.Agent).where(models.Agent.token_id == principal.token_id))
    if agent is None:
        raise Refused("agent-not-registered", f"agent token {principal.name!r} must register before it claims work")
    return agent
