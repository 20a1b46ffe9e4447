"""Who uses the web UI: anyone may read (as the REST reads, unless COOP_PUBLIC_READ is off); an operator
signs in with an operator token, whose id the encrypted session cookie keeps and every request checks again
(a revoked token ends the session). Actions are HTML form posts behind that session and a CSRF token."""

from __future__ import annotations

import uuid
from typing import Any, TypeAlias

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Redirect
from sqlalchemy.ext.asyncio import AsyncSession

from server import auth, models
from server.errors import Unauthenticated
from server.tokens import Principal

# Handler options: an action changes something and needs a signed-in operator; a public page (sign-in)
# is open even where reads are not.
WebRequest: TypeAlias = Request[Any, Any, Any]

ACTION = {"action": True}
PUBLIC = {"public": True}
TOKEN_ID = "token_id"
NOTICE = "notice"


class SignInRequired(Unauthenticated):
    """Answered with a redirect to the sign-in page."""


async def _viewer(connection: ASGIConnection) -> Principal | None:  # type: ignore[type-arg]
    raw = connection.session.get(TOKEN_ID)
    if not isinstance(raw, str):
        return None
    ctx = auth.context(connection)
    # The request's own session (and transaction), as the API's guard does.
    session = ctx.database.provide_session(connection.app.state, connection.scope)
    token = await session.get(models.Token, uuid.UUID(raw))
    if token is None or token.revoked_at is not None or token.role != "operator":
        connection.clear_session()
        return None
    return Principal(token.id, token.name, "operator")


async def guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:  # type: ignore[type-arg]
    viewer = await _viewer(connection)
    connection.state.viewer = viewer
    if viewer is not None or handler.opt.get("public"):
        return
    if handler.opt.get("action"):
        raise SignInRequired("sign in with an operator token to do this")
    if not auth.context(connection).settings.public_read:
        raise SignInRequired("this coordinator's pages are for signed-in operators")


def sign_in(request: WebRequest, principal: Principal) -> None:
    request.set_session({TOKEN_ID: str(principal.token_id)})


def viewer(request: WebRequest) -> Principal | None:
    found = request.state.get("viewer")
    return found if isinstance(found, Principal) else None


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
