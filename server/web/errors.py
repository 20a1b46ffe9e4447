"""Errors on the UI's routes as pages (the API answers the same errors as JSON problems)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from litestar import Response
from litestar.exceptions import HTTPException
from litestar.response import Redirect

from experiment.core.errors import CoopError
from server.dispatch.lifecycle import Refused
from server.httperrors import BadRequest, Forbidden, NotFound, TooLarge, Unauthenticated
from server.web import gate, render
from server.web.gate import WebRequest

_STATUS: tuple[tuple[type[CoopError], int], ...] = (
    (NotFound, 404),
    (Unauthenticated, 401),
    (Forbidden, 403),
    (Refused, 409),
    (TooLarge, 413),
    (BadRequest, 400),
)


def page(request: WebRequest, exc: Exception) -> Response[Any]:
    if isinstance(exc, gate.SignInRequired):
        back = request.url.path if request.method == "GET" else "/"
        return Redirect(f"/login?next={quote(back)}", status_code=303)
    if isinstance(exc, HTTPException):
        status, detail = exc.status_code, exc.detail
    else:
        status = next((code for kind, code in _STATUS if isinstance(exc, kind)), 400)
        detail = str(exc)
    return render.page(request, "error.html", status, status=status, detail=detail)
