"""The API's reads of the coordinator's own rows, and an agent's registration: every experiment, agent, job of an
experiment and attempt of a job in id order, and an attempt's events a page at a time."""

from __future__ import annotations

import datetime
import uuid

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import models
from server.store import cursors, views

MAX_EVENTS = 10_000  # a page of events; a long run's are read in pages
MAX_PAGE_BYTES = 1024 * 1024  # a page of events also ends once its JSON passes this size
EVENT_CHUNK = 1000  # events read from the database at a time while a page is filled


async def experiments(session: AsyncSession) -> list[wire.Experiment]:
    return [
        views.experiment(row) for row in await session.scalars(select(models.Experiment).order_by(models.Experiment.id))
    ]


async def agents(session: AsyncSession) -> list[wire.Agent]:
    return [views.agent(row) for row in await session.scalars(select(models.Agent).order_by(models.Agent.id))]


async def jobs(session: AsyncSession, experiment_id: uuid.UUID) -> list[wire.Job]:
    rows = await session.scalars(
        select(models.Job).where(models.Job.experiment_id == experiment_id).order_by(models.Job.id)
    )
    return [views.job(row) for row in rows]


async def attempts(session: AsyncSession, job_id: uuid.UUID) -> list[wire.Attempt]:
    rows = await session.scalars(
        select(models.Attempt)
        .where(models.Attempt.job_id == job_id)
        .order_by(models.Attempt.number, models.Attempt.rank)
    )
    return [views.attempt(row) for row in rows]


async def register(
    session: AsyncSession, name: str, token_id: uuid.UUID, data: wire.AgentRegister, now: datetime.datetime
) -> models.Agent:
    """The agent of the agent token ``token_id`` (named ``name``): made at its first registration, its addresses and
    labels updated at the next ones."""
    agent = await session.scalar(select(models.Agent).where(models.Agent.token_id == token_id))
    if agent is None:
        agent = models.Agent(
            name=name,
            token_id=token_id,
            address=data.address,
            private_address=data.private_address,
            labels=data.labels,
            last_seen_at=now,
        )
        session.add(agent)
    else:
        agent.address, agent.private_address = data.address, data.private_address
        agent.labels, agent.last_seen_at = dict(data.labels), now
    return agent


async def events(
    session: AsyncSession, attempt_id: uuid.UUID, kind: str | None, after: str | None, limit: int
) -> wire.EventPage:
    """The attempt's events in the order recorded, after the cursor ``after``: a page ends at ``limit`` events or
    once its events pass MAX_PAGE_BYTES of JSON, whichever comes first; ``next`` then names the rest."""
    listing = select(models.Event).where(
        models.Event.attempt_id == attempt_id, *(() if kind is None else (models.Event.kind == kind,))
    )
    if after is not None:
        previous = await cursors.row(session, listing, models.Event.id, after)
        listing = listing.where(models.Event.id > previous.id)
    items: list[wire.RecordedEvent] = []
    size, last = 0, None
    while len(items) < limit and size < MAX_PAGE_BYTES:
        chunk = min(EVENT_CHUNK, limit - len(items))
        bounded = listing if last is None else listing.where(models.Event.id > last)
        rows = list(await session.scalars(bounded.order_by(models.Event.id).limit(chunk)))
        for row in rows:
            item = views.event(row)
            items.append(item)
            size += len(msgspec.json.encode(item))
            last = row.id
            if size >= MAX_PAGE_BYTES:
                break
        if len(rows) < chunk:
            break
    if last is None:
        return wire.EventPage(items=items, next=None)
    rest = listing.with_only_columns(models.Event.id).where(models.Event.id > last).limit(1)
    more = await session.scalar(rest) is not None
    return wire.EventPage(items=items, next=cursors.encode(last) if more else None)
