"""Content-addressed blobs: the body streams to a temporary file while it is hashed, and only a body whose
sha256 is the one named becomes ``COOP_HOME/blobs/ab/abcdef...``: one file per blob, written once, never
overwritten (a second upload of the same content finds it there). A disk that fills up during the upload ends it
with InsufficientStorage (507) and leaves nothing behind: the temporary file goes, and no row is written."""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio.to_thread
from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core import canonical
from server import failpoints, models
from server.httperrors import BadRequest, InsufficientStorage, NotFound, TooLarge
from server.settings import Settings
from server.store import views

INCOMING = ".incoming"
FULL = (errno.ENOSPC, errno.EDQUOT)


def path_of(settings: Settings, sha256: str) -> Path:
    return settings.blob_dir / sha256[:2] / sha256


def _install(temp: Path, final: Path) -> None:
    """Link the verified temporary file into place; an existing file of that name is the same content."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(temp, final)
    except FileExistsError:
        pass
    else:
        canonical.fsync_path(final.parent)
    finally:
        temp.unlink(missing_ok=True)


def clear_incoming(settings: Settings) -> None:
    """Remove what uploads of a coordinator that died left half-received: none of it is a blob (a blob is under its
    name only once whole). Called as the coordinator starts, before it takes an upload."""
    incoming = settings.blob_dir / INCOMING
    for leftover in incoming.iterdir() if incoming.is_dir() else []:
        leftover.unlink(missing_ok=True)


def free_bytes(settings: Settings) -> int:
    """The space left on the blob store's disk."""
    return canonical.free_bytes(settings.blob_dir)


async def _receive(settings: Settings, sha256: str, chunks: AsyncIterator[bytes], quota: tuple[int, str] | None) -> int:
    digest, size = hashlib.sha256(), 0
    temp: Path | None = None
    try:
        incoming = settings.blob_dir / INCOMING
        incoming.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f"{sha256[:12]}.", dir=incoming)
        temp = Path(name)
        with os.fdopen(fd, "wb") as handle:
            async for chunk in chunks:
                size += len(chunk)
                if size > settings.max_blob_bytes:
                    raise TooLarge(f"the blob is larger than the limit of {settings.max_blob_bytes} bytes")
                if quota is not None and size > quota[0]:
                    raise TooLarge(f"the blob is larger than {quota[1]}")
                digest.update(chunk)
                handle.write(chunk)
            handle.flush()
            await anyio.to_thread.run_sync(os.fsync, handle.fileno())
        if digest.hexdigest() != sha256:
            raise BadRequest(f"the body's sha256 is {digest.hexdigest()}, not {sha256}; a blob is named by its content")
        failpoints.reach("blob.received")
        await anyio.to_thread.run_sync(_install, temp, path_of(settings, sha256))
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        raise InsufficientStorage(
            f"the blob store {settings.blob_dir} is full: blob {sha256} was not kept ({size} bytes received, "
            f"{free_bytes(settings)} bytes free); send it again once space is freed"
        ) from exc
    finally:
        if temp is not None:
            temp.unlink(missing_ok=True)
    return size


async def store(
    session: AsyncSession,
    settings: Settings,
    sha256: str,
    chunks: AsyncIterator[bytes],
    media_type: str,
    declared_size: int | None,
    quota: tuple[int, str] | None = None,
) -> wire.Blob:
    """Receive and verify a blob; storing the same content again changes nothing (``created`` is False). With a
    ``quota`` (bytes, and the sentence that names it), a body over it is refused as one over the blob limit is."""
    if declared_size is not None and declared_size > settings.max_blob_bytes:
        raise TooLarge(f"the blob ({declared_size} bytes) is larger than the limit of {settings.max_blob_bytes} bytes")
    if quota is not None and declared_size is not None and declared_size > quota[0]:
        raise TooLarge(f"the blob ({declared_size} bytes) is larger than {quota[1]}")
    size = await _receive(settings, sha256, chunks, quota)
    failpoints.reach("blob.installed")
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    added = await session.execute(
        dialect.insert(models.Blob)
        .values(sha256=sha256, size=size, media_type=media_type)
        .on_conflict_do_nothing(index_elements=[models.Blob.sha256])
    )
    created = getattr(added, "rowcount", 0) == 1
    return wire.Blob(sha256=sha256, size=size, media_type=media_type, created=created)


async def find(session: AsyncSession, settings: Settings, sha256: str) -> tuple[models.Blob, Path]:
    blob = await session.scalar(select(models.Blob).where(models.Blob.sha256 == sha256))
    if blob is None:
        raise NotFound(f"no blob {sha256} is stored; upload it with PUT /api/blobs/{sha256}")
    path = path_of(settings, sha256)
    if not path.is_file():
        raise NotFound(f"blob {sha256} is recorded but its file {path} is missing from the blob store")
    return blob, path


async def sizes(session: AsyncSession, digests: set[str]) -> dict[str, int]:
    """The size of every stored blob among ``digests``."""
    rows = await session.execute(select(models.Blob.sha256, models.Blob.size).where(models.Blob.sha256.in_(digests)))
    return {sha256: size for sha256, size in rows}


async def store_bytes(session: AsyncSession, settings: Settings, data: bytes) -> str:
    """Keep the coordinator's own JSON ``data`` as a blob; its name (the sha256 of the bytes)."""
    digest = canonical.sha256_bytes(data)

    async def chunks() -> AsyncIterator[bytes]:
        yield data

    await store(session, settings, digest, chunks(), "application/json", len(data))
    return digest


async def evidence_quota(session: AsyncSession, experiment_id: uuid.UUID, attempt_id: uuid.UUID) -> tuple[int, int]:
    """An attempt's evidence quota (its plan's, in bytes) and what its uploads have used of it."""
    quota = views.plan_of(await session.get_one(models.Experiment, experiment_id)).evidence_quota()
    # Each blob once: the same content again (a spooled upload replayed after a lost reply) costs nothing more.
    uploaded = (
        select(models.AttemptUpload.sha256, models.AttemptUpload.size)
        .where(models.AttemptUpload.attempt_id == attempt_id)
        .distinct()
        .subquery()
    )
    used = await session.scalar(select(func.coalesce(func.sum(uploaded.c.size), 0)))
    return quota, int(used or 0)


def record_upload(session: AsyncSession, attempt_id: uuid.UUID, sha256: str, size: int) -> None:
    """The attempt uploaded the blob: it counts against the attempt's evidence quota."""
    session.add(models.AttemptUpload(attempt_id=attempt_id, sha256=sha256, size=size))
