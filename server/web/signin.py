"""Signing in with an operator or a reader token (checked as the API checks bearer tokens) and signing out."""

from __future__ import annotations

import msgspec
from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import FromQuery, URLEncodedBody
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from server.access import audit, tokens
from server.web import gate, render
from server.web.gate import WebRequest


class SignInForm(msgspec.Struct, frozen=True):
    token: str
    next: str = "/"


def _local(target: str) -> str:
    """Where to go after signing in: a path on this coordinator only, never another site."""
    return target if target.startswith("/") and not target.startswith("//") and "\\" not in target else "/"


class SignInPages(Controller):
    path = "/"
    opt = gate.PUBLIC

    @get("/login")
    async def form(self, request: WebRequest, next: FromQuery[str] = "/") -> Template:
        return render.page(request, "login.html", next=_local(next), problem=None)

    @post("/login")
    async def sign_in(
        self,
        request: WebRequest,
        data: URLEncodedBody[SignInForm],
        db_session: NamedDependency[AsyncSession],
    ) -> Redirect | Template:
        principal = await tokens.lookup(db_session, data.token.strip())
        if principal is None or principal.role not in gate.SIGNS_IN:
            problem = (
                "That is not an operator or a reader token, or it was revoked. "
                "Create one with coop-server token create."
            )
            return render.page(request, "login.html", 401, next=_local(data.next), problem=problem)
        csrf_cookie = await gate.sign_in(request, db_session, principal)
        await audit.record(db_session, principal, "web.sign-in", f"token:{principal.name}")
        await db_session.commit()
        return Redirect(_local(data.next), status_code=303, cookies=[csrf_cookie])

    @post("/logout")
    async def sign_out(self, request: WebRequest, db_session: NamedDependency[AsyncSession]) -> Redirect:
        await gate.sign_out(request, db_session)
        await db_session.commit()
        return Redirect("/", status_code=303)
