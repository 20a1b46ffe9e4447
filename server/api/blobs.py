"""Blobs: content-addressed upload (agents and the operator) and download."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from litestar import Controller, Request, Response, get, put
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIFormat, OpenAPIMediaType, OpenAPIType, Operation, RequestBody, Schema
from litestar.params import FromPath, QueryParameter
from litestar.response import File
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server.access import audit, auth
from server.access.tokens import Principal
from server.api import spec
from server.dispatch import queue
from server.httperrors import BadRequest, TooLarge
from server.settings import Settings
from server.store import blobstore

_SHA256 = re.compile("^[0-9a-f]{64}$")


def _digest(sha256: str) -> str:
    if not _SHA256.match(sha256):
        raise BadRequest(f"{sha256!r} is not a sha256 hex digest (64 lowercase hex digits)")
    return sha256


async def _require_active_attempt(
    session: AsyncSession, request: Request[Any, Any, Any], principal: Principal, attempt_id: uuid.UUID | None
) -> tuple[uuid.UUID, tuple[int, str]]:
    """The agent's active attempt the upload names, and what its evidence quota leaves: (bytes, in words)."""
    if attempt_id is None:
        raise BadRequest("an agent's blob upload names its attempt: PUT /api/blobs/SHA256?attempt=ATTEMPT_ID")
    agent = auth.calling_agent(request, principal)  # the row the guard read
    job, attempt = await queue.owned_attempt(session, agent, attempt_id, None)
    queue.require_active(attempt)
    quota, used = await blobstore.evidence_quota(session, job.experiment_id, attempt.id)
    left = quota - used
    words = f"what attempt {attempt.id}'s evidence quota leaves: {left} of its plan's {quota} bytes"
    if left <= 0:
        raise TooLarge(f"attempt {attempt.id} has uploaded its plan's evidence quota of {quota} bytes")
    return attempt.id, (left, words)


@dataclass
class _BlobUpload(Operation):
    """The upload's body is the blob's bytes, streamed (not a parameter the handler decodes)."""

    def __post_init__(self) -> None:
        binary = OpenAPIMediaType(schema=Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY))
        self.request_body = RequestBody(
            content={"application/octet-stream": binary},
            required=True,
            description="The blob's bytes; their sha256 must be the path's",
        )


_UPLOAD = spec.write(("agent", "operator"), streams=True, upload="blob")
_UPLOAD["responses"] |= {
    201: ResponseSpec(data_container=wire.Blob, description="Stored now", generate_examples=False),
    **spec.responses(507),
}


class BlobController(Controller):
    path = "/api/blobs"
    tags = ("blobs",)

    @put(
        "/{sha256:str}",
        operation_id="uploadBlob",
        operation_class=_BlobUpload,
        # The blob limit (settings.max_blob_bytes) is enforced while the body streams to disk.
        **_UPLOAD,
    )
    async def upload(
        self,
        sha256: FromPath[str],
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
        principal: NamedDependency[Principal],
        attempt: Annotated[
            uuid.UUID | None,
            QueryParameter(description="the agent's attempt this evidence belongs to (agent tokens must name it)"),
        ] = None,
    ) -> Response[wire.Blob]:
        """Store the body under its sha256; the server hashes it and refuses a body that is not that content.
        An agent names the attempt the blob is evidence of: an attempt that has ended gets 409, and a body past what
        the attempt's evidence quota leaves (sized from its plan: Plan.evidence_quota) gets 413 naming the quota."""
        digest = _digest(sha256)
        quota: tuple[int, str] | None = None
        owner: uuid.UUID | None = None
        if principal.role == "agent":
            owner, quota = await _require_active_attempt(db_session, request, principal, attempt)
            await db_session.commit()  # the check's transaction ends before the body streams
        blob = await blobstore.store(
            db_session, settings, digest, request.stream(), "application/octet-stream", request.content_length, quota
        )
        if owner is not None:
            blobstore.record_upload(db_session, owner, digest, blob.size)
        if blob.created:
            await audit.record(db_session, principal, "blob.upload", f"blob:{sha256}", size=blob.size)
        return Response(blob, status_code=201 if blob.created else 200)

    @get("/{sha256:str}", operation_id="downloadBlob", media_type="application/octet-stream", **spec.read())
    async def download(
        self, sha256: FromPath[str], db_session: NamedDependency[AsyncSession], settings: NamedDependency[Settings]
    ) -> File:
        """The stored bytes, always as an attachment of type application/octet-stream: a blob is served as data,
        never with a content type an uploader chose."""
        _, path = await blobstore.find(db_session, settings, _digest(sha256))
        return File(path, media_type="application/octet-stream", filename=sha256)
