"""Blobs: content-addressed upload (agents and the operator) and download."""

from __future__ import annotations

import re
from typing import Any

from litestar import Controller, Request, Response, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import File
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import audit, blobs
from server.errors import BadRequest
from server.settings import Settings
from server.tokens import Principal

WRITERS = {"role": ("agent", "operator")}
_SHA256 = re.compile("^[0-9a-f]{64}$")


def _digest(sha256: str) -> str:
    if not _SHA256.match(sha256):
        raise BadRequest(f"{sha256!r} is not a sha256 hex digest (64 lowercase hex digits)")
    return sha256


class BlobController(Controller):
    path = "/api/blobs"
    tags = ("blobs",)

    @put(
        "/{sha256:str}",
        operation_id="uploadBlob",
        opt=WRITERS,
        # The blob limit (settings.max_blob_bytes) is enforced while the body streams to disk.
        request_max_body_size=None,
        response_description="wire.Blob: 201 when stored now, 200 when it was already stored",
    )
    async def upload(
        self,
        sha256: FromPath[str],
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
        principal: NamedDependency[Principal],
    ) -> Response[wire.Blob]:
        """Store the body under its sha256; the server hashes it and refuses a body that is not that content."""
        media_type = request.headers.get("content-type") or "application/octet-stream"
        blob = await blobs.store(
            db_session, settings, _digest(sha256), request.stream(), media_type[:100], request.content_length
        )
        if blob.created:
            audit.record(db_session, principal, "blob.upload", f"blob:{sha256}", size=blob.size)
        return Response(blob, status_code=201 if blob.created else 200)

    @get("/{sha256:str}", operation_id="downloadBlob", media_type="application/octet-stream")
    async def download(
        self, sha256: FromPath[str], db_session: NamedDependency[AsyncSession], settings: NamedDependency[Settings]
    ) -> File:
        blob, path = await blobs.find(db_session, settings, _digest(sha256))
        return File(path, media_type=blob.media_type, filename=sha256)
