"""The leased job queue: atomic claims, gang claims for multi-rank jobs, heartbeats, the reaper, cancel.

It knows jobs and attempts only: every call that ends attempts returns what ended (``Ended``), and the caller
hands that to server.protocol.reactions, which records what a success commits and advances the experiment.

A claim is one UPDATE … RETURNING of one job row chosen by a subquery, built once and bound to each claim's
parameters. On Postgres the subquery reads ``FOR UPDATE``: it waits for an open gang rank's row and skips a locked
queued job, and claims take turns on an advisory lock. On SQLite the write lock taken at BEGIN IMMEDIATE serialises
claimers. Each lease is an attempt row; a retry is a new attempt row, and no attempt is rewritten once it has ended.

Retries (lifecycle.JOB_TRANSITIONS says why): a lost job is queued again while it has had fewer than
``max_attempts`` generations; a failed one is final. A gang that does not form within ``gang_form_seconds``
of its rank-0 claim is requeued with its attempts cancelled, without using up a retry.
"""

from __future__ import annotations

import datetime
import hashlib
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import (
    ColumnElement,
    CursorResult,
    Row,
    and_,
    bindparam,
    case,
    func,
    insert,
    literal,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.selectable import ExecutableReturnsRows, FromClause, ScalarSelect
from uuid_utils.compat import uuid7

from experiment import wire
from experiment.core.canonical import JsonObject
from experiment.core.states import JobState
from server import models
from server.dispatch import lifecycle, waiters
from server.dispatch.lifecycle import EXPERIMENT_FINAL, JOB_ACTIVE, JOB_FINAL, Refused
from server.httperrors import Forbidden, NotFound
from server.settings import Settings

J = JobState
ACTIVE = [J.LEASED, J.RUNNING]
NOT_HELD = "not held by its agent: its heartbeat did not name it"
# The tables, for the Core statements that read and write rows without ORM objects.
_TABLES = models.Job.metadata.tables
_jobs, _attempts, _agents = (_TABLES[name] for name in ("jobs", "attempts", "agents"))


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class Caller:
    """The agent a request comes from, as the guard read its row with its token: what the queue judges it by."""

    id: uuid.UUID
    address: str
    private_address: str | None
    last_seen_at: datetime.datetime


@dataclass(frozen=True)
class Ended:
    """An attempt (None: a job cancelled before any claim) ended, and ``outcome`` is its job's state after it:
    succeeded once every rank did, another final state, or queued or active while the job goes on."""

    job: models.Job
    attempt: models.Attempt | None
    outcome: JobState

    @property
    def succeeded(self) -> bool:
        return self.outcome == J.SUCCEEDED


_GENERATION = (
    select(models.Attempt)
    .where(models.Attempt.job_id == bindparam("job_id"), models.Attempt.number == bindparam("number"))
    .order_by(models.Attempt.rank)
)


async def generation(session: AsyncSession, job: models.Job) -> list[models.Attempt]:
    """The attempts of the job's current generation, by rank."""
    return list(await session.scalars(_GENERATION, {"job_id": job.id, "number": job.attempts_made}))


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def rendezvous_port(settings: Settings, job_id: uuid.UUID, number: int) -> int:
    """A port per job and attempt, so that a retry never meets a half-closed rendezvous of the last one."""
    return settings.rendezvous_port_base + (job_id.int + number) % settings.rendezvous_port_span


# Claims take turns on Postgres, as SQLite's single writer makes them: two claims at one instant would otherwise
# each take rank 0 of a different gang (the second skips the first's locked row), and with one free agent each both
# gangs would wait out their formation. Held to the claim's commit; SQLite needs none.
CLAIM_TURN = 0x636F6F70  # "coop"
_TAKE_TURN = select(func.pg_advisory_xact_lock(CLAIM_TURN))


# An agent's claim binds its id here; the coordinator's own worker has none (its attempts' agent is null).
_AGENT_ID = bindparam("agent_id", type_=_attempts.c.agent_id.type)


@dataclass(frozen=True)
class _Claimant:
    """Whose claim a statement makes: an agent's (``agent_id``) or the coordinator's own worker's."""

    by_coordinator: bool

    def this(self, column: ColumnElement[uuid.UUID | None]) -> ColumnElement[bool]:
        return column.is_(None) if self.by_coordinator else column == _AGENT_ID

    def another(self, column: ColumnElement[uuid.UUID | None]) -> ColumnElement[bool]:
        return column.is_not(None) if self.by_coordinator else column != _AGENT_ID

    def open_to(self, row: FromClause) -> ColumnElement[bool]:
        """A queued job pinned to no host, or to this one."""
        return or_(row.c.pinned_agent_id.is_(None), self.this(row.c.pinned_agent_id))


def _claim_statement(by_coordinator: bool) -> ExecutableReturnsRows:
    """The claim: one UPDATE … RETURNING of the job it leases a rank of. Its subquery picks an open rank of a gang
    this agent is not already in, else a queued job it may claim (rank 0 of a gang), the oldest first within each.
    An agent's claim changes nothing when its claim key was given before (``claim`` then looks for what that key
    was given). Parameters: ``agent_id`` and ``claim_key`` (both absent for the coordinator's own worker),
    ``kinds`` and ``now``.

    Built on the tables, not the ORM's classes: the job comes back as a row, and the claim changes it with Core
    statements of its own, so no ORM statement is compiled or object loaded."""
    claimant = _Claimant(by_coordinator)
    was_queued = _jobs.c.state == J.QUEUED
    return (
        update(_jobs)
        .where(*_claim_conditions(claimant, _chosen_job(claimant), was_queued))
        .values(**_leased_values(was_queued))
        .returning(*_CLAIMED)
    )


def _chosen_job(claimant: _Claimant) -> ColumnElement[uuid.UUID]:
    """The job's id the claim's subquery picks: an open rank of a forming gang, else a queued job."""
    candidate = _jobs.alias("candidate")
    live = _live(candidate)
    # An open rank of a forming gang is waited for while another transaction holds its job's row (a rank starting,
    # a heartbeat): skipping it would start another gang on this agent, and leave both a rank short until their
    # formation wait ends. Claims never wait on each other's rows: on Postgres they take turns (CLAIM_TURN).
    return func.coalesce(
        _oldest(
            candidate,
            live,
            candidate.c.state.in_(ACTIVE),
            candidate.c.ranks_open > 0,
            ~_in_its_gang(candidate, claimant),
            ~_held_by_another(candidate, claimant),
            skip_locked=False,
        ),
        _oldest(candidate, live, candidate.c.state == J.QUEUED, claimant.open_to(candidate), skip_locked=True),
    )


def _in_its_gang(candidate: FromClause, claimant: _Claimant) -> ColumnElement[bool]:
    """The claimant holds a rank of the candidate's current generation already."""
    return (
        select(_attempts.c.id)
        .where(
            _attempts.c.job_id == candidate.c.id,
            _attempts.c.number == candidate.c.attempts_made,
            claimant.this(_attempts.c.agent_id),
        )
        .exists()
    )


def _held_by_another(candidate: FromClause, claimant: _Claimant) -> ColumnElement[bool]:
    """A retry's rank goes back to the host that held it in the generation before (each rank resumes from its own
    checkpoints: a DiLoCo worker's optimizer is its own); a rank nobody held there is open to any host."""
    previous = _attempts.alias("previous")
    return (
        select(previous.c.id)
        .where(
            previous.c.job_id == candidate.c.id,
            previous.c.number == candidate.c.attempts_made - 1,
            previous.c.rank == candidate.c.world_size - candidate.c.ranks_open,
            claimant.another(previous.c.agent_id),
        )
        .exists()
    )


def _live(candidate: FromClause) -> ColumnElement[bool]:
    """A job of an experiment that has ended (reported, failed, halted) is never handed out."""
    experiments = _TABLES["experiments"]
    return (
        select(experiments.c.id)
        .where(experiments.c.id == candidate.c.experiment_id, experiments.c.state.not_in(list(EXPERIMENT_FINAL)))
        .exists()
    )


def _oldest(
    candidate: FromClause, live: ColumnElement[bool], *where: ColumnElement[bool], skip_locked: bool
) -> ScalarSelect[uuid.UUID]:
    """The oldest live job of the claim's kinds that meets ``where``: read in the order of the state's index
    (ix_jobs_state_queued), which stops at the first that does."""
    return (
        select(candidate.c.id)
        .where(*where, candidate.c.kind.in_(bindparam("kinds", expanding=True)), live)
        .order_by(candidate.c.queued_at, candidate.c.id)
        .limit(1)
        .with_for_update(skip_locked=skip_locked)
        .scalar_subquery()
    )


def _claim_conditions(
    claimant: _Claimant, chosen: ColumnElement[uuid.UUID], was_queued: ColumnElement[bool]
) -> list[ColumnElement[bool]]:
    """The chosen row, still claimable; for an agent, a claim key it has not given before."""
    # The row's state is checked again: on Postgres a row the reaper changed since the subquery read it is read
    # anew here, and a rank of a generation that ended is never joined.
    conditions = [
        _jobs.c.id == chosen,
        or_(
            and_(_jobs.c.state.in_(ACTIVE), _jobs.c.ranks_open > 0),
            and_(was_queued, claimant.open_to(_jobs)),
        ),
    ]
    if not claimant.by_coordinator:
        given = select(_attempts.c.id).where(
            _attempts.c.agent_id == _AGENT_ID, _attempts.c.claim_key == bindparam("claim_key")
        )
        conditions.append(~given.exists())
    return conditions


def _leased_values(was_queued: ColumnElement[bool]) -> dict[str, ColumnElement[Any]]:
    """A queued job becomes leased, its next generation's other ranks open and its rendezvous cleared; a forming
    gang's job has one rank fewer open."""
    job = _jobs
    return {
        "state": case((was_queued, literal(lifecycle.leased_state(), job.c.state.type)), else_=job.c.state),
        "attempts_made": case((was_queued, job.c.attempts_made + 1), else_=job.c.attempts_made),
        "ranks_open": case((was_queued, job.c.world_size - 1), else_=job.c.ranks_open - 1),
        "master_addr": case((was_queued, null()), else_=job.c.master_addr),
        "master_port": case((was_queued, null()), else_=job.c.master_port),
        "updated_at": bindparam("now", type_=job.c.updated_at.type),
    }


# What a claim reads of the job it leased.
_CLAIMED = [
    _jobs.c[name]
    for name in (
        "id",
        "experiment_id",
        "kind",
        "arm",
        "role",
        "spec",
        "attempts_made",
        "world_size",
        "ranks_open",
        "master_addr",
        "master_port",
        "formation_deadline",
    )
]
# A gang's rank 0 sets where its gang meets and by when; its last rank clears the deadline.
_GANG = update(_jobs).where(_jobs.c.id == bindparam("job_id"))


# Built once: a claim binds its parameters to these.
_CLAIM_BY_AGENT = _claim_statement(by_coordinator=False)
_CLAIM_BY_COORDINATOR = _claim_statement(by_coordinator=True)
_NEW_ATTEMPT = insert(models.Attempt.metadata.tables["attempts"])


async def _claim_row(
    session: AsyncSession, agent: Caller | None, kinds: Sequence[str], claim_key: str | None
) -> Row[Any] | None:
    """Lease one rank: first an open rank of a gang this agent is not already in, else a queued job; none where
    the agent gave ``claim_key`` before."""
    if session.get_bind().dialect.name == "postgresql":
        await session.execute(_TAKE_TURN)
    parameters: dict[str, object] = {"kinds": list(kinds), "now": _now()}
    if agent is not None:
        parameters["agent_id"], parameters["claim_key"] = agent.id, claim_key
    statement = _CLAIM_BY_COORDINATOR if agent is None else _CLAIM_BY_AGENT
    return (await session.execute(statement, parameters)).one_or_none()


def _lease(settings: Settings, attempt: models.Attempt) -> str:
    """A new lease token for the attempt (only its hash is kept) and a full lease term from now."""
    token = secrets.token_urlsafe(32)
    attempt.lease_token_hash = hash_secret(token)
    attempt.lease_expires_at = _now() + datetime.timedelta(seconds=settings.lease_seconds)
    return token


@dataclass(frozen=True)
class _Leased:
    """The attempt a claim leases, before its row is written (_record_attempt writes it)."""

    id: uuid.UUID
    number: int
    rank: int
    master_addr: str | None
    master_port: int | None
    lease_expires_at: datetime.datetime


def _assignment(job: models.Job | Row[Any], attempt: models.Attempt | _Leased, token: str) -> wire.Assignment:
    """What the agent is handed for one rank of ``job``: the attempt, where its gang meets, its lease."""
    return wire.Assignment(
        job_id=job.id,
        attempt_id=attempt.id,
        experiment_id=job.experiment_id,
        kind=job.kind,
        arm=job.arm,
        role=job.role,
        spec=job.spec,
        number=attempt.number,
        rank=attempt.rank,
        world_size=job.world_size,
        master_addr=attempt.master_addr,
        master_port=attempt.master_port,
        lease_token=token,
        lease_expires_at=attempt.lease_expires_at,
    )


_BY_CLAIM_KEY = (
    select(models.Attempt)
    .where(models.Attempt.agent_id == bindparam("agent_id"), models.Attempt.claim_key == bindparam("claim_key"))
    .with_for_update()
)


async def _claimed_before(
    session: AsyncSession, settings: Settings, agent: Caller, claim_key: str
) -> wire.Assignment | Literal[False] | None:
    """The attempt a retried claim was given the first time (its reply was lost), with a new lease token;
    None when that attempt has ended since; False when the key is new."""
    attempt = await session.scalar(_BY_CLAIM_KEY, {"agent_id": agent.id, "claim_key": claim_key})
    if attempt is None:
        return False
    if attempt.state != J.LEASED:
        return None  # ended (or started, which its agent would have needed the first reply for)
    job = await session.get_one(models.Job, attempt.job_id)
    return _assignment(job, attempt, _lease(settings, attempt))


async def claim(
    session: AsyncSession,
    settings: Settings,
    agent: Caller | None,
    kinds: Sequence[str],
    claim_key: str | None = None,
) -> wire.Assignment | None:
    """One claim of a job of one of ``kinds``, in the session's current transaction; the caller commits. ``agent``
    None is the coordinator's own worker (server.reporter). A claim key seen before from this agent gets the
    attempt of its first claim again, never a second one."""
    job = await _claim_row(session, agent, kinds, claim_key)
    if job is None:
        if agent is None or claim_key is None:
            return None
        # Nothing was leased: the queue had nothing for this agent, or the key was given before (its reply lost).
        earlier = await _claimed_before(session, settings, agent, claim_key)
        return None if earlier is False else earlier
    rank = job.world_size - job.ranks_open - 1
    now = _now()
    master_addr, master_port = await _meet(session, settings, agent, job, rank, now)
    token = secrets.token_urlsafe(32)  # a new lease token: only its hash is kept
    expires = now + datetime.timedelta(seconds=settings.lease_seconds)
    leased = _Leased(uuid7(), job.attempts_made, rank, master_addr, master_port, expires)
    assignment = _assignment(job, leased, token)
    await _record_attempt(session, agent, claim_key, assignment)
    return assignment


async def _meet(
    session: AsyncSession, settings: Settings, agent: Caller | None, job: Row[Any], rank: int, now: datetime.datetime
) -> tuple[str | None, int | None]:
    """Where the claimed rank's gang meets: a gang's rank 0 sets it and the deadline to form by; its last rank
    clears that deadline."""
    master_addr, master_port = job.master_addr, job.master_port
    gang: dict[str, object] = {}
    if rank == 0 and job.world_size > 1 and agent is not None:
        master_addr = agent.private_address or agent.address  # the gang meets on the private link
        master_port = rendezvous_port(settings, job.id, job.attempts_made)
        deadline = now + datetime.timedelta(seconds=settings.gang_form_seconds)
        gang = {"master_addr": master_addr, "master_port": master_port, "formation_deadline": deadline}
    if job.ranks_open > 0:
        waiters.claimable(session)  # the gang's other ranks are open to other agents
    elif job.formation_deadline is not None:
        gang = {"formation_deadline": None}
    if gang:
        await session.execute(_GANG, {"job_id": job.id, "updated_at": now, **gang})
    return master_addr, master_port


async def _record_attempt(
    session: AsyncSession, agent: Caller | None, claim_key: str | None, assignment: wire.Assignment
) -> None:
    """The claim's attempt and its state event, as Core INSERTs: the claim makes no ORM object of its own."""
    await session.execute(
        _NEW_ATTEMPT,
        {
            "id": assignment.attempt_id,
            "job_id": assignment.job_id,
            "number": assignment.number,
            "rank": assignment.rank,
            "agent_id": None if agent is None else agent.id,
            "state": J.LEASED,
            "claim_key": claim_key,
            "master_addr": assignment.master_addr,
            "master_port": assignment.master_port,
            "lease_token_hash": hash_secret(assignment.lease_token),
            "lease_expires_at": assignment.lease_expires_at,
        },
    )
    await session.execute(
        lifecycle.NEW_EVENT,
        lifecycle.claim_event(
            assignment.experiment_id, assignment.job_id, assignment.attempt_id, assignment.rank, assignment.number
        ),
    )


async def _settle(session: AsyncSession, job: models.Job, ended: models.Attempt) -> Ended:
    """Bring the job in line with an attempt that just ended: a gang ends together; a lost job is retried."""
    if ended.number == job.attempts_made:  # else an attempt of an earlier generation: its job has moved on
        await _settle_generation(session, job, ended)
    return Ended(job, ended, job.state)


async def _settle_generation(session: AsyncSession, job: models.Job, ended: models.Attempt) -> None:
    generation_ = await generation(session, job)
    outcome = ended.state
    if outcome in {J.LOST, J.FAILED, J.CANCELLED}:
        running = [sibling for sibling in generation_ if sibling.state in ACTIVE]
        if outcome == J.FAILED and running and job.cancel_requested_at is None:
            # A gang rank fails when a peer's host vanishes (its collective breaks). Whether this generation
            # was lost or failed is known once every rank ended: the peers still running finish or fail on
            # their own, and a vanished one's lease expires (lost, so the job is retried).
            return
        if any(sibling.state == J.LOST for sibling in generation_):
            outcome = J.LOST
        for sibling in running:
            if sibling.state in ACTIVE:
                lifecycle.move_attempt(
                    session,
                    job,
                    sibling,
                    J.CANCELLED,
                    f"rank {ended.rank} {outcome}: the ranks of a gang end together",
                )
        job.ranks_open, job.formation_deadline = 0, None
        if job.state in JOB_FINAL:
            return
        target = J.CANCELLED if job.cancel_requested_at is not None else outcome
        lifecycle.move_job(session, job, target, f"rank {ended.rank} of attempt {ended.number} {outcome}")
        tried = job.attempts_made - job.formation_timeouts
        if target == J.LOST and tried < job.max_attempts:
            lifecycle.move_job(session, job, J.QUEUED, f"retry {tried + 1} of {job.max_attempts}")
            job.ranks_open, job.master_addr, job.master_port = job.world_size, None, None
            if job.world_size > 1:
                # Each rank resumes from its own checkpoints: the retry's rank 0 is claimed on rank 0's host.
                job.pinned_agent_id = next(a.agent_id for a in generation_ if a.rank == 0)
        return
    if job.ranks_open == 0 and all(a.state == J.SUCCEEDED for a in generation_):
        lifecycle.move_job(session, job, J.SUCCEEDED, f"every rank of attempt {job.attempts_made} succeeded")


async def _requeue_unformed(session: AsyncSession, settings: Settings, now: datetime.datetime) -> int:
    """Requeue every gang still missing ranks past its formation deadline, cancelling the ranks it has."""
    unformed = list(
        await session.scalars(
            select(models.Job)
            .where(models.Job.state.in_(ACTIVE), models.Job.ranks_open > 0, models.Job.formation_deadline < now)
            .order_by(models.Job.id)
            .with_for_update(skip_locked=True)
        )
    )
    for job in unformed:
        claimed = job.world_size - job.ranks_open
        reason = (
            f"the gang did not form within {settings.gang_form_seconds:g}s: "
            f"{claimed} of {job.world_size} ranks were claimed"
        )
        for attempt in await generation(session, job):
            if attempt.state in ACTIVE:
                lifecycle.move_attempt(session, job, attempt, J.CANCELLED, reason)
        lifecycle.move_job(session, job, J.QUEUED, reason)
        job.formation_timeouts += 1
        job.ranks_open, job.master_addr, job.master_port, job.formation_deadline = job.world_size, None, None, None
    return len(unformed)


async def _active_where(session: AsyncSession, passed: ColumnElement[bool]) -> list[models.Attempt]:
    """The active attempts whose deadline has ``passed``, locked (any that another reaper holds is left to it)."""
    return list(
        await session.scalars(
            select(models.Attempt)
            .where(models.Attempt.state.in_(ACTIVE), passed)
            .order_by(models.Attempt.id)
            .with_for_update(skip_locked=True)
        )
    )


async def reap(session: AsyncSession, settings: Settings) -> list[Ended]:
    """Turn expired leases into ``lost``, overdue cancellations into ``cancelled`` and requeue gangs that did
    not form; returns the attempts it ended."""
    now = _now()
    expired = await _active_where(session, models.Attempt.lease_expires_at < now)
    overdue = await _active_where(session, models.Attempt.cancel_deadline < now)
    ended = []
    for attempt, target, reason in [
        *((a, J.LOST, f"lease expired at {a.lease_expires_at.isoformat()}") for a in expired),
        *((a, J.CANCELLED, "did not stop within the grace period") for a in overdue),
    ]:
        if attempt.state not in ACTIVE:
            continue  # already ended above, as a sibling of another rank
        job = await session.get_one(models.Job, attempt.job_id, with_for_update=True)
        lifecycle.move_attempt(session, job, attempt, target, reason)
        ended.append(await _settle(session, job, attempt))
    await _requeue_unformed(session, settings, now)
    return ended


async def renew_after_restart(session: AsyncSession, settings: Settings) -> int:
    """At coordinator start: no agent could heartbeat while it was down, so every running lease gets a full
    term again before the reaper looks (a host that really vanished still loses its lease one term later)."""
    renewed = await session.execute(
        update(models.Attempt)
        .where(models.Attempt.state.in_(ACTIVE))
        .values(lease_expires_at=_now() + datetime.timedelta(seconds=settings.lease_seconds))
        .execution_options(synchronize_session=False)
    )
    assert isinstance(renewed, CursorResult)  # an UPDATE's result counts its rows
    return renewed.rowcount


def _require_holder(
    attempt_id: uuid.UUID, holder: uuid.UUID | None, token_hash: str, agent: Caller | None, lease_token: str | None
) -> None:
    """The attempt is held by ``holder``: refused unless that is this agent (None: the coordinator) and, when
    given, the lease token is the attempt's."""
    if holder != (None if agent is None else agent.id):
        raise Forbidden(f"attempt {attempt_id} is leased to another agent; an agent acts only on its own leases")
    if lease_token is not None and not secrets.compare_digest(token_hash, hash_secret(lease_token)):
        raise Forbidden(f"the lease token does not match attempt {attempt_id}")


async def owned_attempt(
    session: AsyncSession, agent: Caller | None, attempt_id: uuid.UUID, lease_token: str | None
) -> tuple[models.Job, models.Attempt]:
    """The attempt and its job, if this agent (None: the coordinator) holds it (and, when given, the lease token
    matches)."""
    attempt = await session.get(models.Attempt, attempt_id, with_for_update=True)
    if attempt is None:
        raise NotFound(f"attempt {attempt_id} does not exist")
    _require_holder(attempt_id, attempt.agent_id, attempt.lease_token_hash, agent, lease_token)
    job = await session.get_one(models.Job, attempt.job_id, with_for_update=True)
    return job, attempt


@dataclass(frozen=True)
class Owned:
    """What an event batch needs of the attempt it goes to and of its job, read as one row."""

    attempt_id: uuid.UUID
    state: str
    reason: str | None
    job_id: uuid.UUID
    kind: str
    experiment_id: uuid.UUID


_OWNED = (
    select(
        _attempts.c.id,
        _attempts.c.agent_id,
        _attempts.c.lease_token_hash,
        _attempts.c.state,
        _attempts.c.reason,
        _jobs.c.id.label("job_id"),
        _jobs.c.kind,
        _jobs.c.experiment_id,
    )
    .join(_jobs, _jobs.c.id == _attempts.c.job_id)
    .where(_attempts.c.id == bindparam("attempt_id"))
    .with_for_update()
)


async def owned_row(session: AsyncSession, agent: Caller, attempt_id: uuid.UUID, lease_token: str) -> Owned:
    """``owned_attempt`` for a request that changes neither row: one Core read of both, no ORM object."""
    row = (await session.execute(_OWNED, {"attempt_id": attempt_id})).first()
    if row is None:
        raise NotFound(f"attempt {attempt_id} does not exist")
    _require_holder(attempt_id, row.agent_id, row.lease_token_hash, agent, lease_token)
    return Owned(row.id, row.state, row.reason, row.job_id, row.kind, row.experiment_id)


def require_active(attempt: models.Attempt | Owned) -> None:
    attempt_id = attempt.attempt_id if isinstance(attempt, Owned) else attempt.id
    if attempt.state not in ACTIVE:
        raise Refused(
            "attempt-already-ended",
            f"attempt {attempt_id} is {attempt.state} ({attempt.reason}); stop it and claim new work",
        )


async def start(session: AsyncSession, agent: Caller | None, attempt_id: uuid.UUID, lease_token: str) -> models.Attempt:
    job, attempt = await owned_attempt(session, agent, attempt_id, lease_token)
    require_active(attempt)
    if attempt.state == J.LEASED:
        lifecycle.move_attempt(session, job, attempt, J.RUNNING, "the agent started the command")
    if job.state == J.LEASED:
        lifecycle.move_job(session, job, J.RUNNING, f"rank {attempt.rank} started")
    return attempt


@dataclass(frozen=True)
class Ending:
    """How an attempt ended, as its agent (or the coordinator) reports it: the outcome, the command's exit code, why
    in words, and the result (its job kind's, untagged)."""

    outcome: wire.Outcome
    exit_code: int | None = None
    reason: str | None = None
    result: JsonObject | None = None


async def finish(session: AsyncSession, job: models.Job, attempt: models.Attempt, ending: Ending) -> Ended:
    """End an attempt as reported; the caller checked ownership (``owned_attempt``) and the result."""
    require_active(attempt)
    attempt.exit_code, attempt.result = ending.exit_code, ending.result or {}
    reason = ending.reason or f"the agent reported {ending.outcome}"
    lifecycle.move_attempt(session, job, attempt, lifecycle.ENDED_AS[ending.outcome], reason)
    return await _settle(session, job, attempt)


# A heartbeat's writes, as Core statements built once: the unit of work's flush of the same rows cost a third of a
# heartbeat's CPU. ``updated_at`` is set as the ORM's listener would set it. Neither holds an IN list: SQLAlchemy
# renders one anew at every execution (an expanding parameter), where plain comparisons are compiled once.
# Every active attempt of an agent has its lease renewed, and comes back as the row a heartbeat judges and answers it
# by: one statement, where a read and then an update of the attempts named were two. An attempt the heartbeat then
# ends (not named) is ended in the same transaction, so its renewal never counts; one claimed since the agent's
# previous heartbeat, whose claim reply may still be on its way, keeps a lease from now rather than from its claim.
_RENEW = (
    update(_attempts)
    .where(_attempts.c.agent_id == bindparam("holder"), or_(*(_attempts.c.state == state for state in ACTIVE)))
    .values(lease_expires_at=bindparam("expires"), updated_at=bindparam("now"))
    .returning(
        _attempts.c.id,
        _attempts.c.job_id,
        _attempts.c.claim_key,
        _attempts.c.created_at,
        _attempts.c.cancel_deadline,
    )
)
_SEEN = (
    update(_agents)
    .where(_agents.c.id == bindparam("agent_id"))
    .values(last_seen_at=bindparam("now"), updated_at=bindparam("now"))
)


async def heartbeat(
    session: AsyncSession,
    settings: Settings,
    agent: Caller,
    attempt_ids: Sequence[uuid.UUID],
    claiming: str | None = None,
) -> tuple[wire.HeartbeatReply, list[Ended]]:
    """Renew the leases of the agent's attempts and tell it, per attempt named, whether to go on.

    An active attempt of the agent that it does not name, and whose claim is not the one it has in flight, is
    not held by it (its result was refused, its claim reply lost, or it restarted): it ends lost and is retried.
    Only attempts claimed before the agent's previous heartbeat was answered are judged, so that a heartbeat
    sent before a claim was made, and answered after, takes nothing away. An agent heartbeats one at a time."""
    now = _now()
    expires = now + datetime.timedelta(seconds=settings.lease_seconds)
    previous = agent.last_seen_at
    named = set(attempt_ids)
    ended = []
    renewal = {"holder": agent.id, "expires": expires, "now": now}
    held = {row.id: row for row in sorted(await session.execute(_RENEW, renewal), key=lambda row: row.id)}
    for row in held.values():
        named_or_claiming = row.id in named or (claiming is not None and row.claim_key == claiming)
        if not named_or_claiming and row.created_at < previous:
            job = await session.get_one(models.Job, row.job_id, with_for_update=True)
            active = await session.get_one(models.Attempt, row.id)
            lifecycle.move_attempt(session, job, active, J.LOST, NOT_HELD)
            ended.append(await _settle(session, job, active))
    await session.execute(_SEEN, {"agent_id": agent.id, "now": now})
    directives = []
    for attempt_id in attempt_ids:
        # An attempt named and held goes on, or stops where cancelled. Any other, and every one once this heartbeat
        # ended attempts (which may have ended others with them), is read as it is now.
        if not ended and (renewing := held.get(attempt_id)) is not None:
            deadline = renewing.cancel_deadline
            if deadline is None:
                directives.append(wire.Directive(attempt_id, "continue"))
            else:
                directives.append(wire.Directive(attempt_id, "stop", "cancelled by the operator", deadline))
            continue
        attempt = await session.get(models.Attempt, attempt_id, populate_existing=True)
        if attempt is None or attempt.agent_id != agent.id:
            directives.append(wire.Directive(attempt_id, "stop", "this agent holds no such attempt"))
        elif attempt.state not in ACTIVE:
            directives.append(wire.Directive(attempt_id, "stop", f"the attempt is {attempt.state}: {attempt.reason}"))
        elif attempt.cancel_deadline is not None:
            directives.append(wire.Directive(attempt_id, "stop", "cancelled by the operator", attempt.cancel_deadline))
        else:
            directives.append(wire.Directive(attempt_id, "continue"))
    return wire.HeartbeatReply(expires, settings.heartbeat_seconds, directives), ended


async def cancel(session: AsyncSession, job: models.Job, grace_seconds: float) -> list[Ended]:
    """A queued job is cancelled at once; a running one is asked to stop, and forced after the grace period."""
    state = job.state
    if state in JOB_FINAL:
        raise Refused("job-already-finished", f"job {job.id} is already {state}")
    if state == J.QUEUED:
        lifecycle.move_job(session, job, J.CANCELLED, "cancelled by the operator before any claim")
        return [Ended(job, None, J.CANCELLED)]
    now = _now()
    job.cancel_requested_at = now
    job.ranks_open = 0
    deadline = now + datetime.timedelta(seconds=grace_seconds)
    for attempt in await generation(session, job):
        if attempt.state in JOB_ACTIVE:
            attempt.cancel_deadline = deadline
    return []
