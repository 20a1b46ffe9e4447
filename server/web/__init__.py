"""The web UI: server-rendered pages (web/templates) with htmx polling their live parts, on the same app as
the API. Its router carries its own session cookie, CSRF check and sign-in guard, so the bearer-token API
never sees them; ``server.access.auth.authorize`` leaves the router's handlers (marked ``opt["web"]``) to it."""

from __future__ import annotations

from litestar import Router
from litestar.datastructures import ResponseHeader
from litestar.di import Provide
from litestar.exceptions import HTTPException
from litestar.middleware import DefineMiddleware
from litestar.middleware.csrf import CSRFMiddleware
from litestar.middleware.session.base import SessionMiddleware
from litestar.middleware.session.client_side import ClientSideSessionBackend, CookieBackendConfig
from litestar.static_files import create_static_files_router
from litestar.types import ASGIApp, ControllerRouterHandler

from experiment.core.errors import CoopError
from server.settings import Settings
from server.web import acting, csrf, errors, gate, keys, render
from server.web.agents import AgentPages
from server.web.evaluations import EvaluationPages
from server.web.jobs import JobPages
from server.web.overview import OverviewPages
from server.web.render import template_config
from server.web.report import ReportPages
from server.web.resources import ResourcePages
from server.web.serving import ServingPages
from server.web.signin import SignInPages
from server.web.training import TrainingPages

__all__ = ["routes", "template_config"]

OPT = {"web": True}
# The pages load their one script (htmx) and stylesheet from this coordinator, run no inline script, and are framed
# by no other page. Inline styles stay allowed: matplotlib's SVG figures, drawn into the pages, carry their own
# <style> and style attributes, as htmx's indicator does; no script runs from them.
CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
HEADERS = [ResponseHeader(name="Content-Security-Policy", value=CSP)]


def _sessions(app: ASGIApp, secret: bytes, secure: bool) -> ASGIApp:
    """Litestar's encrypted cookie session, which holds the id of a ``web_sessions`` row (server.web.gate), built
    when a route's middleware stack is: registering the router deep-copies it, and the backend's AES-GCM key object
    cannot be copied. Its Max-Age follows each answer; the session's end is the row's."""
    config = CookieBackendConfig(
        secret=secret,
        key="coop_session",
        max_age=gate.SESSION_HOURS * 3600,
        httponly=True,
        samesite="lax",
        secure=secure,
    )
    return SessionMiddleware(app=app, backend=ClientSideSessionBackend(config=config))


def routes(settings: Settings) -> list[ControllerRouterHandler]:
    secrets = keys.load(settings.home)
    pages = Router(
        path="/",
        route_handlers=[
            OverviewPages,
            TrainingPages,
            JobPages,
            AgentPages,
            EvaluationPages,
            ServingPages,
            ReportPages,
            ResourcePages,
            SignInPages,
        ],
        middleware=[
            DefineMiddleware(_sessions, secret=secrets.session, secure=settings.tls),
            DefineMiddleware(CSRFMiddleware, config=csrf.config(settings.home, settings.tls)),
        ],
        guards=[gate.guard],
        dependencies={"operator": Provide(acting.operator, sync_to_thread=False)},
        exception_handlers={CoopError: errors.page, HTTPException: errors.page},
        opt=OPT,
        include_in_schema=False,
        response_headers=HEADERS,
    )
    assets = [
        create_static_files_router(path="/static", directories=[render.STATIC], opt=OPT, include_in_schema=False),
        create_static_files_router(
            path="/vendor/htmx", directories=[render.HTMX], name="htmx", opt=OPT, include_in_schema=False
        ),
    ]
    return [pages, *assets]
