"""The evidence bundle `coop report --home BUNDLE` reads (docs/evidence.md), assembled from blobs.

Agents upload each evidence file as a blob and name it in their result (path in the bundle -> sha256);
the operator attaches what it wrote (selection.json). The export is a tar of the files of every job's
succeeded generation plus ``ledger.json``, the commitment ledger as ``experiment.core.ledger`` reads it, and
``attempts.json``, every training attempt (server.store.trainattempts).
"""

from __future__ import annotations

import tarfile
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core.canonical import sha256_bytes
from experiment.core.layout import ATTEMPTS, LEDGER
from experiment.core.states import JobState
from server import models
from server.dispatch.lifecycle import Refused
from server.httperrors import BadRequest
from server.settings import Settings
from server.store import blobstore, commitments, trainattempts

CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE


def _check_path(path: str) -> None:
    if any(part in {"", ".", ".."} for part in path.split("/")):
        raise BadRequest(f"evidence path {path!r} has an empty, '.' or '..' segment")
    if path in (LEDGER, ATTEMPTS):
        raise BadRequest(f"{path} is written by the coordinator from its own records; it is not uploaded")


async def _require_blobs(session: AsyncSession, files: Mapping[str, str]) -> None:
    stored = await blobstore.sizes(session, set(files.values()))
    missing = sorted(path for path, sha256 in files.items() if sha256 not in stored)
    if missing:
        raise Refused(
            "evidence-blob-not-uploaded",
            f"upload the blobs before naming them: no blob is stored for {', '.join(missing)}",
        )


async def _conflicts(
    session: AsyncSession, experiment_id: uuid.UUID, job_id: uuid.UUID | None, path: str, sha256: str
) -> list[tuple[models.EvidenceFile, uuid.UUID | None]]:
    """Refuse a path that another job's succeeded generation (or the operator) recorded with other content; the
    path's current rows."""
    current = await _current(session, experiment_id, path)
    for row, row_job in current:
        if row.sha256 != sha256 and (row_job is None or row_job != job_id):
            raise Refused(
                "evidence-path-conflict",
                f"{path} is already recorded with sha256 {row.sha256[:12]}...; evidence is never replaced",
            )
    return current


async def record(
    session: AsyncSession,
    job: models.Job,
    attempt: models.Attempt,
    files: Mapping[str, str],
    prefixes: tuple[str, ...],
) -> None:
    """Record the evidence an attempt wrote under the folders its job's kind writes (``prefixes``:
    server.protocol.kinds); the caller checked that it succeeded."""
    for path in files:
        _check_path(path)
        if not path.startswith(prefixes):
            raise Refused(
                "evidence-outside-job",
                f"rank {attempt.rank} of a {job.kind} job writes only under {', '.join(prefixes) or 'nothing'}; "
                f"not {path}",
            )
    await _require_blobs(session, files)
    for path, sha256 in sorted(files.items()):
        await _conflicts(session, job.experiment_id, job.id, path, sha256)
        session.add(
            models.EvidenceFile(experiment_id=job.experiment_id, attempt_id=attempt.id, path=path, sha256=sha256)
        )


async def attach(session: AsyncSession, experiment_id: uuid.UUID, files: Mapping[str, str]) -> None:
    """Record evidence the operator wrote; attaching the same content again changes nothing."""
    for path in files:
        _check_path(path)
    await _require_blobs(session, files)
    for path, sha256 in sorted(files.items()):
        current = await _conflicts(session, experiment_id, None, path, sha256)
        if not any(row.sha256 == sha256 for row, _ in current):
            session.add(models.EvidenceFile(experiment_id=experiment_id, attempt_id=None, path=path, sha256=sha256))


async def keep(session: AsyncSession, settings: Settings, experiment_id: uuid.UUID, path: str, data: bytes) -> None:
    """Keep the coordinator's own bundle file ``path`` (a commitment's canonical bytes): stored as a blob and
    named, as the operator's evidence is (keeping the same content again changes nothing)."""
    _check_path(path)
    sha256 = sha256_bytes(data)
    current = await _conflicts(session, experiment_id, None, path, sha256)
    await blobstore.store_bytes(session, settings, data)
    if not any(row.sha256 == sha256 for row, _ in current):
        session.add(models.EvidenceFile(experiment_id=experiment_id, attempt_id=None, path=path, sha256=sha256))


async def _current(
    session: AsyncSession, experiment_id: uuid.UUID, path: str | None = None
) -> list[tuple[models.EvidenceFile, uuid.UUID | None]]:
    """Evidence that counts, with its job: the operator's, and each job's succeeded generation's."""
    statement = (
        select(models.EvidenceFile, models.Job.id)
        .outerjoin(models.Attempt, models.Attempt.id == models.EvidenceFile.attempt_id)
        .outerjoin(models.Job, models.Job.id == models.Attempt.job_id)
        .where(
            models.EvidenceFile.experiment_id == experiment_id,
            or_(
                models.EvidenceFile.attempt_id.is_(None),
                (models.Job.state == JobState.SUCCEEDED) & (models.Attempt.number == models.Job.attempts_made),
            ),
        )
        .order_by(models.EvidenceFile.path, models.EvidenceFile.id)
    )
    if path is not None:
        statement = statement.where(models.EvidenceFile.path == path)
    rows = await session.execute(statement)
    return [(row, job_id) for row, job_id in rows]


async def listing(session: AsyncSession, experiment_id: uuid.UUID) -> list[wire.EvidenceFile]:
    """The bundle's files (without ledger.json), one per path."""
    chosen: dict[str, models.EvidenceFile] = {}
    for row, _ in await _current(session, experiment_id):
        earlier = chosen.setdefault(row.path, row)
        if earlier.sha256 != row.sha256:
            raise Refused("evidence-path-conflict", f"{row.path} is recorded twice with different content")
    sizes = await blobstore.sizes(session, {row.sha256 for row in chosen.values()})
    return [wire.EvidenceFile(path, row.sha256, sizes[row.sha256], row.attempt_id) for path, row in chosen.items()]


@dataclass(frozen=True)
class Member:
    path: str
    size: int
    source: Path | bytes


async def members(session: AsyncSession, settings: Settings, experiment_id: uuid.UUID) -> list[Member]:
    listed = [
        Member(f.path, f.size, blobstore.path_of(settings, f.sha256)) for f in await listing(session, experiment_id)
    ]
    ledger = msgspec.json.encode(await commitments.entries(session, experiment_id))
    attempts = await trainattempts.record(session, experiment_id)
    written = [Member(LEDGER, len(ledger), ledger), Member(ATTEMPTS, len(attempts), attempts)]
    return sorted([*listed, *written], key=lambda member: member.path)


def _header(member: Member) -> bytes:
    info = tarfile.TarInfo(member.path)
    info.size, info.mode, info.mtime, info.type = member.size, 0o644, 0, tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT)


def tar_stream(chosen: list[Member]) -> Iterator[bytes]:
    """A POSIX tar of ``chosen``, produced piece by piece (no member is held in memory whole)."""
    written = 0
    for member in chosen:
        header = _header(member)
        yield header
        written += len(header)
        if isinstance(member.source, bytes):
            yield member.source
            sent = len(member.source)
        else:
            sent = 0
            with member.source.open("rb") as handle:
                while chunk := handle.read(CHUNK):
                    sent += len(chunk)
                    yield chunk
            if sent != member.size:
                raise OSError(f"blob file {member.source} changed size ({sent} bytes, recorded {member.size})")
        written += sent
        padding = -sent % BLOCK
        yield b"\0" * padding
        written += padding
    end = 2 * BLOCK
    yield b"\0" * (end + (-(written + end) % RECORD))
