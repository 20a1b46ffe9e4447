"""Who uses the web UI: anyone may read (as the REST reads, unless COOP_PUBLIC_READ is off); an operator or a
reader signs in with a token of that role. The encrypted session cookie names a row of ``web_sessions``, which every
request checks again: it ends at sign-out, SESSION_HOURS after sign-in, or when its token is revoked. Actions are
HTML form posts from this coordinator's own origin, behind an operator's session and a CSRF token bound to that
session; a signed-in reader reads and is refused every action."""

from __future__ import annotations

import datetime
import uuid
from typing import Any, TypeAlias
from urllib.parse import urlsplit

from litestar import Request
from litestar.datastructures import Cookie
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Redirect
from sqlalchemy.ext.asyncio import AsyncSession

from server.access import auth
from server.access.auth import Connection
from server.access.roles import Role
from server.access.tokens import Principal
from server.httperrors import Forbidden, Unauthenticated
from server.store import websessions
from server.web import csrf

# Handler options: an action changes something and needs a signed-in operator; a public page (sign-in)
# is open even where reads are not.
WebRequest: TypeAlias = Request[Any, Any, Any]

ACTION = {"action": True}
PUBLIC = {"public": True}
SESSION_ID = "session"
NOTICE = "notice"


class SignInRequired(Unauthenticated):
    """Answered with a redirect to the sign-in page."""


SIGNS_IN: tuple[Role, ...] = ("operator", "reader")
SESSION_HOURS = 12  # a session's absolute lifetime: it ends this long after sign-in, however busy
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _session_id(connection: Connection) -> uuid.UUID | None:
    raw = connection.session.get(SESSION_ID)
    try:
        return uuid.UUID(raw) if isinstance(raw, str) else None
    except ValueError:
        return None


async def _signed_in(connection: Connection) -> Principal | None:
    """Whoever the cookie's session row says, while that row has neither ended nor expired and its token stands;
    any other cookie is cleared."""
    session_id = _session_id(connection)
    if session_id is None:
        if connection.session:
            connection.clear_session()
        return None
    ctx = auth.context(connection)
    # The request's own session (and transaction), as the API's guard does.
    session = ctx.database.provide_session(connection.app.state, connection.scope)
    row = await websessions.standing(session, session_id)
    role = next((known for known in SIGNS_IN if row is not None and known == row.role), None)
    if row is None or row.ended_at is not None or row.expires_at <= _now() or row.revoked_at is not None or not role:
        connection.clear_session()
        return None
    connection.state.web_session = session_id
    return Principal(row.token_id, row.name, role)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _same_origin(connection: Connection) -> bool:
    """A form posted from this coordinator's own pages: a browser names their origin in ``Origin`` on every
    unsafe request (a client that sends none, such as curl, is not a browser another site can drive)."""
    origin = connection.headers.get("origin")
    if origin is None:
        return True
    host = connection.headers.get("host", "")
    parts = urlsplit(origin)
    return parts.scheme in {"http", "https"} and bool(host) and parts.netloc.lower() == host.lower()


async def guard(connection: Connection, handler: BaseRouteHandler) -> None:
    unsafe = connection.scope.get("method", "GET") not in SAFE_METHODS
    if unsafe and not _same_origin(connection):
        raise Forbidden(f"a form from another site ({connection.headers.get('origin')}) may not act here")
    principal = await _signed_in(connection)
    connection.state.signed_in = principal
    if unsafe and principal is not None and not csrf.bound(connection, connection.state.web_session):
        raise Forbidden("the form's CSRF token is not this session's: reload the page and send the form again")
    if handler.opt.get("action") and principal is not None and principal.role != "operator":
        raise Forbidden(f"{principal.name!r} is a {principal.role} token, which reads only: sign in as an operator")
    if principal is not None or handler.opt.get("public"):
        return
    if handler.opt.get("action"):
        raise SignInRequired("sign in with an operator token to do this")
    if not auth.context(connection).settings.public_read:
        raise SignInRequired("this coordinator's pages are for signed-in operators")


async def sign_in(request: WebRequest, session: AsyncSession, principal: Principal) -> Cookie:
    """Begin a session of ``principal``'s, named by the session cookie; the CSRF cookie to send with the answer,
    whose token is bound to this session alone."""
    expires_at = _now() + datetime.timedelta(hours=SESSION_HOURS)
    session_id = await websessions.begin(session, principal.token_id, expires_at)
    request.set_session({SESSION_ID: str(session_id)})
    return csrf.cookie(request, session_id)


async def sign_out(request: WebRequest, session: AsyncSession) -> None:
    """End the request's session on the server, so that its cookie, replayed, signs nobody in."""
    found = request.state.get("web_session")
    if isinstance(found, uuid.UUID):
        await websessions.end(session, found, _now())
    request.clear_session()


def signed_in(request: WebRequest) -> Principal | None:
    """Whoever signed in: an operator or a reader."""
    found = request.state.get("signed_in")
    return found if isinstance(found, Principal) else None


def viewer(request: WebRequest) -> Principal | None:
    """The signed-in operator, who may act; None for a reader or nobody."""
    found = signed_in(request)
    return found if found is not None and found.role == "operator" else None


def operator(request: WebRequest) -> Principal:
    found = viewer(request)
    if found is None:
        raise SignInRequired("sign in with an operator token to do this")
    return found


def notify(request: WebRequest, message: str) -> None:
    """A one-time message for the next page this operator sees."""
    request.session[NOTICE] = message


async def refused(request: WebRequest, db_session: AsyncSession, detail: str, back: str) -> Redirect:
    """An action the protocol refused: nothing of it is kept, the operator reads why on the page it came from."""
    await db_session.rollback()
    notify(request, f"Refused: {detail}")
    return Redirect(back, status_code=303)


def take_notice(request: WebRequest) -> str | None:
    found = request.session.pop(NOTICE, None)
    return found if isinstance(found, str) else None
