"""Cursors of paged listings: the id of a page's last row, opaque to the client, given as the page's ``next`` and
taken back as ``after=``. A cursor that does not name a row of the same listing is refused (400)."""

from __future__ import annotations

import base64
import binascii
import uuid
from typing import Any, TypeVar

from sqlalchemy import Select
from sqlalchemy.ext.asyncio import AsyncSession

from server.httperrors import BadRequest

Row = TypeVar("Row")


def encode(row_id: uuid.UUID) -> str:
    return base64.urlsafe_b64encode(row_id.bytes).rstrip(b"=").decode()


def _decode(cursor: str) -> uuid.UUID:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        if len(raw) != 16 or encode(uuid.UUID(bytes=raw)) != cursor:
            raise ValueError(cursor)
    except (ValueError, binascii.Error):
        raise BadRequest(f"after={cursor[:64]!r} is not a cursor: pass the next of the page before") from None
    return uuid.UUID(bytes=raw)


async def row(session: AsyncSession, listing: Select[Row], row_id: Any, cursor: str) -> Row:
    """The row ``cursor`` names, which must be one of ``listing``'s (``row_id``: the listed model's id column)."""
    found = await session.scalar(listing.where(row_id == _decode(cursor)))
    if found is None:
        raise BadRequest(f"after={cursor!r} names no row of this listing: pass the next of the page before")
    return found
