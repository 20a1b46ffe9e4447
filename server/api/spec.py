"""What each API route declares once, for both the server and its OpenAPI document: the token roles it takes,
the largest body it reads, and every refusal it can answer (each a wire.Problem)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Components, SecurityScheme

from experiment import wire
from server.access.roles import ROLES

# The handler option that names an agent upload (events, result, blob).
UPLOAD = "upload"

KIB = 1024
# Body limits, sized to each route's real bodies: a control message, a small document (a selection, a job's spec,
# a list of evidence files), a plan; event batches and results use the app-wide limit (settings.max_body_bytes).
CONTROL = 16 * KIB
DOCUMENT = 256 * KIB
PLAN = 2 * KIB * KIB

_PROBLEMS = {
    400: "The request is malformed; the detail names the field",
    401: "No bearer token, or an unknown or revoked one (reads too, when the coordinator's reads are not public)",
    403: "A token of another role (a reader's on any write), or an agent acting on another agent's attempt",
    404: "No such experiment, job, attempt or blob",
    409: "Refused by the protocol: the rule names the step or state that forbids it",
    413: "The body is larger than this route's limit",
    503: "The coordinator lost its connection to the database (it restarted): retry after Retry-After seconds",
    507: "The blob store's disk is full: nothing was kept; send the same upload again once space is freed",
}

SECURITY_SCHEMES = Components(
    security_schemes={
        role: SecurityScheme(
            type="http", scheme="bearer", description=f"a token of role {role} (coop-server token create)"
        )
        for role in ROLES
    }
)


def responses(*codes: int) -> dict[int, ResponseSpec]:
    """The documented problem answers of ``codes``."""
    return {
        code: ResponseSpec(data_container=wire.Problem, description=_PROBLEMS[code], generate_examples=False)
        for code in sorted(codes)
    }


class Route(TypedDict, total=False):
    """What a route decorator (litestar's ``get``, ``post``...) takes from here, as keyword arguments."""

    opt: dict[str, str | tuple[str, ...]]  # the roles that may call it; an agent upload's name
    responses: dict[int, ResponseSpec]
    security: list[dict[str, list[str]]]
    request_max_body_size: int | None


def _security(roles: Iterable[str]) -> list[dict[str, list[str]]]:
    """A bearer token of any one of ``roles``."""
    return [{role: []} for role in roles]


def read(*, found: bool = True) -> Route:
    """A public read (a token of any role when reads are not public); ``found``: it names a row (404)."""
    return {
        "responses": responses(400, 401, 503, *((404,) if found else ())),
        "security": [{}, *_security(ROLES)],
    }


def private_read(*roles: str) -> Route:
    """A read that needs a token of one of ``roles`` whatever COOP_PUBLIC_READ says (the coordinator's own
    metrics)."""
    return {"opt": {"role": roles}, "responses": responses(401, 403, 503), "security": _security(roles)}


def write(
    role: str | tuple[str, ...],
    *,
    body: int | None = CONTROL,
    streams: bool = False,
    found: bool = True,
    upload: str | None = None,
) -> Route:
    """A write by ``role``. ``body`` is its body limit (None: the app-wide limit); a route that ``streams`` its
    body enforces its own limit while it reads. ``upload`` names an agent upload, whose refusals are counted
    (server.prometheus)."""
    route: Route = {
        "opt": {"role": role, **({UPLOAD: upload} if upload else {})},
        "responses": responses(400, 401, 403, 409, 413, 503, *((404,) if found else ())),
        "security": _security((role,) if isinstance(role, str) else role),
    }
    if streams or body is not None:
        route["request_max_body_size"] = None if streams else body
    return route
