"""Who may do what: reads are public unless switched off; writes need a bearer token of the handler's role.

A handler declares its role in ``opt={"role": ...}`` (a role, or a tuple of roles); the app-wide guard
resolves the token, checks the role and leaves the principal (and an agent's row) on the connection for the
``principal`` and ``call`` dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from advanced_alchemy.extensions.litestar import SQLAlchemyAsyncConfig
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from server import db
from server.access import tokens
from server.access.tokens import Principal
from server.dispatch.lifecycle import Refused
from server.dispatch.queue import Caller
from server.httperrors import Forbidden, Unauthenticated
from server.settings import Settings

STATE_KEY = "coop"

# Any request or websocket, whatever its handler, user, auth and state types.
Connection = ASGIConnection[Any, Any, Any, Any]


@dataclass(frozen=True)
class Context:
    """What the app keeps in ``app.state``: its settings, a session maker for work outside a request, and
    the plugin's config, whose ``provide_session`` gives the guard the request's own session."""

    settings: Settings
    sessions: async_sessionmaker[AsyncSession]
    database: SQLAlchemyAsyncConfig


def context(connection: Connection) -> Context:
    value = connection.app.state[STATE_KEY]
    assert isinstance(value, Context)
    return value


def _bearer(connection: Connection) -> str | None:
    header = connection.headers.get("authorization")
    if header is None:
        return None
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <token>'")
    return secret.strip()


# A body no larger than this is read before its token is looked up: it came with the request's first packets, and
# one lookup serves an agent's frequent small requests (heartbeats, claims). A larger body waits for its token.
SMALL_BODY_BYTES = 64 * 1024

# The dependency of an agent's frequent routes (server.api.calls), whose token is read in the handler's transaction.
CALL = "call"


async def authorize(connection: Connection, handler: BaseRouteHandler) -> None:
    """Check the token, and set the request's database session up so that no request holds the SQLite write
    lock while it reads a body or waits: the token and an agent's row are read by one statement, on SQLite
    outside any transaction (one statement reads one snapshot); a GET stays a reader; any other method's handler
    writes in transactions of its own.

    A handler that takes ``call`` (claim, heartbeat, start, events, result) has its body read first, and then its
    token in the write transaction that the handler goes on with: one transaction, not a read and then a write.
    A body that may be larger than SMALL_BODY_BYTES waits for its token to be found first, in a read of its own, so
    that a stranger's request is refused before its body is received. Its body is checked only once its token is
    (server.store.bodies)."""
    ctx = context(connection)
    session = ctx.database.provide_session(connection.app.state, connection.scope)
    if CALL in handler.parsed_fn_signature.parameters and isinstance(connection, Request):
        secret = _required_bearer(connection)  # no body is read for a request that sends no token
        length = connection.content_length
        if length is None or length > SMALL_BODY_BYTES:
            await _known(session, secret)
        await connection.body()
        await _check(connection, handler, ctx, session, alone=False)
        return
    writes = connection.scope.get("method", "GET") not in {"GET", "HEAD"}
    db.reading(session)
    db.one_statement(session, True)
    try:
        await _check(connection, handler, ctx, session, alone=True)
        await session.commit()
    finally:
        db.one_statement(session, False)
        if writes:
            db.writing(session)


async def _check(
    connection: Connection,
    handler: BaseRouteHandler,
    ctx: Context,
    session: AsyncSession,
    *,
    alone: bool,
) -> None:
    """Leave the principal (and an agent's row) on ``connection``, read in ``session``: in a read of its own when
    ``alone``, else in the session's transaction, which the handler goes on with."""
    if handler.opt.get("web") or handler.opt.get("public"):
        return  # the web UI's pages and assets (server.web checks their session cookie) and /health
    role = handler.opt.get("role")
    if role is None and (ctx.settings.public_read or connection.url.path.startswith("/schema")):
        return
    secret = _required_bearer(connection)
    if alone:
        await db.read_alone(session)
    principal, agent = await tokens.lookup_with_agent(session, secret)
    if principal is None:
        raise Unauthenticated("the bearer token is unknown or revoked")
    roles = (role,) if isinstance(role, str) else tuple(role or ())
    if roles and principal.role not in roles:
        raise Forbidden(f"this request needs {_either(roles)} token; {principal.name!r} is {_a(principal.role)} token")
    connection.state.principal = principal
    if principal.role == "agent":
        connection.state.agent = agent


async def _known(session: AsyncSession, secret: str) -> None:
    """Refuse an unknown or revoked token by one read outside any transaction, which the session then leaves."""
    db.one_statement(session, True)
    try:
        await db.read_alone(session)
        principal, _ = await tokens.lookup_with_agent(session, secret)
        await session.commit()
    finally:
        db.one_statement(session, False)
    if principal is None:
        raise Unauthenticated("the bearer token is unknown or revoked")


def _required_bearer(connection: Connection) -> str:
    secret = _bearer(connection)
    if secret is None:
        raise Unauthenticated("this request needs a bearer token (Authorization: Bearer <token>)")
    return secret


def _a(role: str) -> str:
    return f"an {role}" if role[0] in "aeiou" else f"a {role}"


def _either(roles: tuple[str, ...]) -> str:
    return " or ".join(_a(role) for role in roles)


def provide_principal(request: Request[Any, Any, Any]) -> Principal:
    principal = request.state.get("principal")
    if not isinstance(principal, Principal):
        raise Unauthenticated("this request needs a bearer token (Authorization: Bearer <token>)")
    return principal


def calling_agent(request: Request[Any, Any, Any], principal: Principal) -> Caller:
    """The calling agent, as the guard read its row (server.api.calls; a blob upload)."""
    agent = request.state.get("agent")
    if not isinstance(agent, Caller):
        raise Refused("agent-not-registered", f"agent token {principal.name!r} must register before it claims work")
    return agent
