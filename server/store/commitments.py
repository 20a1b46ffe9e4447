"""Appending to and reading an experiment's commitment ledger (the chain rules live in experiment/core/ledger.py)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core import ledger
from experiment.core.canonical import JsonObject
from server import failpoints, models


@dataclass(frozen=True)
class Ledger:
    """What the experiment's ledger commits so far (kind -> identity)."""

    committed: Mapping[str, str]

    def has(self, entry: str) -> bool:
        return entry in self.committed


def _entry(row: models.Commitment) -> ledger.Entry:
    return ledger.Entry(row.seq, row.kind, row.identity, row.body, row.prev_hash, row.hash)


async def entries(session: AsyncSession, experiment_id: uuid.UUID) -> list[ledger.Entry]:
    rows = await session.scalars(
        select(models.Commitment)
        .where(models.Commitment.experiment_id == experiment_id)
        .order_by(models.Commitment.seq)
    )
    return [_entry(row) for row in rows]


async def by_kind(session: AsyncSession, experiment_id: uuid.UUID) -> dict[str, ledger.Entry]:
    """The ledger's entries by their kind (each kind is committed once)."""
    return {entry.kind: entry for entry in await entries(session, experiment_id)}


async def committed(session: AsyncSession, experiment_id: uuid.UUID) -> Ledger:
    return Ledger({kind: entry.identity for kind, entry in (await by_kind(session, experiment_id)).items()})


async def append(
    session: AsyncSession, experiment_id: uuid.UUID, kind: str, identity: str, body: JsonObject
) -> ledger.Entry:
    """Link a new entry to the last one; the (experiment, seq) unique key refuses a concurrent fork."""
    last = await session.scalar(
        select(models.Commitment)
        .where(models.Commitment.experiment_id == experiment_id)
        .order_by(models.Commitment.seq.desc())
        .limit(1)
    )
    previous = None if last is None else _entry(last)
    entry = ledger.next_entry(previous, kind, identity, body)
    session.add(
        models.Commitment(
            experiment_id=experiment_id,
            seq=entry.seq,
            kind=entry.kind,
            identity=entry.identity,
            body=entry.body,
            prev_hash=entry.prev_hash,
            hash=entry.hash,
        )
    )
    await session.flush()
    failpoints.reach("commitment.appended")
    return entry
