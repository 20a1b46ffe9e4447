"""Who uses the web UI: anyone may read (as the REST reads, unless COOP_PUBLIC_READ is off); an operator or a
reader signs in with a token of that role, whose id the encrypted session cookie keeps and every request checks
again (a revoked token ends the session). Actions are HTML form posts behind an operator's session and a CSRF
token; a signed-in reader reads and is refused every action."""

from __future__ import annotations

import uuid
from typing import Any, TypeAlias

from litestar import Request
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Redirect
from sqlalchemy.ext.asyncio import AsyncSession

from server import models
from server.access import auth
from server.access.auth import Connection
from server.access.roles import Role
from server.access.tokens import Principal
from server.httperrors import Forbidden, Unauthenticated

# Handler options: an action changes something and needs a signed-in operator; a public page (sign-in)
# is open even where reads are not.
WebRequest: TypeAlias = Request[Any, Any, Any]

ACTION = {"action": True}
PUBLIC = {"public": True}
TOKEN_ID = "token_id"
NOTICE = "notice"


class SignInRequired(Unauthenticated):
    """Answered with a redirect to the sign-in page."""


SIGNS_IN: tuple[Role, ...] = ("operator", "reader")


async def _signed_in(connection: Connection) -> Principal | None:
    raw = connection.session.get(TOKEN_ID)
    if not isinstance(raw, str):
        return None
    ctx = auth.context(connection)
    # The request's own session (and transaction), as the API's guard does.
    session = ctx.database.provide_session(connection.app.state, connection.scope)
    token = await session.get(models.Token, uuid.UUID(raw))
    role = next((known for known in SIGNS_IN if known == token.role), None) if token is not None else None
    if token is None or token.revoked_at is not None or role is None:
        connection.clear_session()
        return None
    return Principal(token.id, token.name, role)


async def guard(connection: Connection, handler: BaseRouteHandler) -> None:
    principal = await _signed_in(connection)
    connection.state.signed_in = principal
    if handler.opt.get("action") and principal is not None and principal.role != "operator":
        raise Forbidden(f"{principal.name!r} is a {principal.role} token, which reads only: sign in as an operator")
    if principal is not None or handler.opt.get("public"):
        return
    if handler.opt.get("action"):
        raise SignInRequired("sign in with an operator token to do this")
    if not auth.context(connection).settings.public_read:
        raise SignInRequired("this coordinator's pages are for signed-in operators")


def sign_in(request: WebRequest, principal: Principal) -> None:
    request.set_session({TOKEN_ID: str(principal.token_id)})


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
