"""The web UI's CSRF tokens: Litestar's double-submit cookie (``coop_csrf``, whose token every form carries), and,
once a browser signs in, a token derived from its session's id, so that a token minted for anyone else (an
anonymous visit to /login, another session) is refused on that session's forms."""

from __future__ import annotations

import hashlib
import hmac
import uuid
from pathlib import Path

from litestar.config.csrf import CSRFConfig
from litestar.datastructures import Cookie
from litestar.middleware.csrf import CSRF_SECRET_LENGTH, generate_csrf_hash

from server.access import auth
from server.access.auth import Connection
from server.web import keys

COOKIE = "coop_csrf"


def config(home: Path, secure: bool) -> CSRFConfig:
    """Litestar's CSRF check: the form's token must be the cookie's. The cookie is Secure when the coordinator
    speaks TLS; over plain HTTP a Secure cookie would never come back, and sign-in would fail."""
    return CSRFConfig(
        secret=keys.load(home).csrf,
        cookie_name=COOKIE,
        cookie_httponly=True,
        cookie_samesite="strict",
        cookie_secure=secure,
    )


def _session_token(secret: str, session_id: uuid.UUID) -> str:
    """The token of one session: its secret part an HMAC of the session's id, then Litestar's signature of it."""
    bound = hmac.new(secret.encode(), f"coop csrf session {session_id}".encode(), hashlib.sha256).hexdigest()
    return bound + generate_csrf_hash(token=bound, secret=secret)


def cookie(connection: Connection, session_id: uuid.UUID) -> Cookie:
    """The CSRF cookie a new session's browser keeps: its token is the session's."""
    settings = auth.context(connection).settings
    value = _session_token(keys.load(settings.home).csrf, session_id)
    return Cookie(key=COOKIE, value=value, httponly=True, samesite="strict", secure=settings.tls, path="/")


def bound(connection: Connection, session_id: object) -> bool:
    """Whether the request's CSRF cookie (which Litestar's check has found equal to the form's token) is the
    token of ``session_id``'s session."""
    found = connection.cookies.get(COOKIE, "")
    if not isinstance(session_id, uuid.UUID) or len(found) <= CSRF_SECRET_LENGTH:
        return False
    expected = _session_token(keys.load(auth.context(connection).settings.home).csrf, session_id)
    return hmac.compare_digest(found[:CSRF_SECRET_LENGTH], expected[:CSRF_SECRET_LENGTH])
