"""Every JSON body is checked before a handler runs, so that no input reaches the database as a value it cannot
hold: the body must decode strictly into the handler's type (no "true" or 0 for a boolean, no "1" for a
number), no text anywhere in it, key or value, may hold a NUL character, which Postgres cannot store, and no
value may nest deeper than MAX_DEPTH arrays and objects (found before the decoder, which a deep enough body would
take past Python's recursion limit). A refusal is a 400 that names the field or the limit."""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

import msgspec
from litestar import Request

from server.httperrors import BadRequest

NUL = "\x00"
# JSON text holds a NUL only as this escape: a raw control character inside a string is malformed JSON.
NUL_ESCAPE = b"\\u0000"
MAX_DEPTH = 64  # arrays and objects nested in one another; no wire type comes near it
# A JSON string, escapes included: its brackets are text, not nesting.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def too_deep(raw: bytes) -> bool:
    """Whether the JSON text ``raw`` nests arrays and objects deeper than MAX_DEPTH: counted over its brackets
    outside strings, at C speed but for one pass over the brackets of a body that holds more than MAX_DEPTH."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > MAX_DEPTH


def _nul_paths(value: Any, path: str = "$") -> Iterator[str]:
    if isinstance(value, str):
        if NUL in value:
            yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            if NUL in key:
                yield f"{path} (a key)"
            yield from _nul_paths(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _nul_paths(item, f"{path}[{index}]")


def check(raw: bytes, target: Any) -> None:
    """Raise BadRequest unless ``raw`` decodes strictly into ``target``, nests no deeper than MAX_DEPTH and holds no
    NUL in any text."""
    if too_deep(raw):
        raise BadRequest(f"the body nests arrays and objects deeper than the limit of {MAX_DEPTH} levels")
    try:
        msgspec.json.decode(raw, type=target, strict=True)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"the body is not valid: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if NUL_ESCAPE not in raw:
        return
    where = next(_nul_paths(msgspec.json.decode(raw)), None)
    if where is not None:
        raise BadRequest(f"the body is not valid: a NUL character (\\u0000) in text - at `{where}`")


async def before_request(request: Request[Any, Any, Any]) -> None:
    """The API's JSON bodies (the web UI's forms are parsed by their own pages)."""
    field = request.route_handler.parsed_fn_signature.parameters.get("data")
    if field is None or request.route_handler.opt.get("web"):
        return
    check(await request.body(), field.annotation)
