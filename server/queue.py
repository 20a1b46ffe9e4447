"""The leased job queue: atomic claims, gang claims for multi-rank jobs, heartbeats, the reaper, cancel.

It knows jobs and attempts only: every call that ends attempts returns what ended (``Ended``), and the caller
hands that to server.reactions, which records what a success commits and advances the experiment.

A claim is one UPDATE of one queued job row chosen by a subquery (``FOR UPDATE SKIP LOCKED`` on
Postgres; on SQLite the write lock taken at BEGIN IMMEDIATE serialises claimers). Each lease is an
attempt row; a retry is a new attempt row, and no attempt is rewritten once it has ended.

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

from sqlalchemy import ColumnElement, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from experiment import wire
from server import claims, lifecycle, models
from server.errors import Forbidden, NotFound
from server.lifecycle import EXPERIMENT_FINAL, JOB_ACTIVE, JOB_FINAL, JobState, Refused
from server.settings import Settings

J = JobState
ACTIVE = [J.LEASED.value, J.RUNNING.value]
NOT_HELD = "not held by its agent: its heartbeat did not name it"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


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


async def generation(session: AsyncSession, job: models.Job) -> list[models.Attempt]:
    """The attempts of the job's current generation, by rank."""
    rows = await session.scalars(
        select(models.Attempt)
        .where(models.Attempt.job_id == job.id, models.Attempt.number == job.attempts_made)
        .order_by(models.Attempt.rank)
    )
    return list(rows)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def rendezvous_port(settings: Settings, job_id: uuid.UUID, number: int) -> int:
    """A port per job and attempt, so that a retry never meets a half-closed rendezvous of the last one."""
    return settings.rendezvous_port_base + (job_id.int + number) % settings.rendezvous_port_span


# Claims take turns on Postgres, as SQLite's single writer makes them: two claims at one instant would otherwise
# each take rank 0 of a different gang (the second skips the first's locked row), and with one free agent each both
# gangs would wait out their formation. Held to the claim's commit; SQLite needs none.
CLAIM_TURN = 0x636F6F70  # "coop"


async def _claim_row(session: AsyncSession, agent: models.Agent | None, kinds: Sequence[str]) -> uuid.UUID | None:
    """Lease one rank: first an open rank of a gang this agent is not already in, else a queued job."""
    if session.get_bind().dialect.name == "postgresql":
        await session.execute(select(func.pg_advisory_xact_lock(CLAIM_TURN)))
    candidate = aliased(models.Job, name="candidate")
    # A job of an experiment that has ended (reported, failed, halted) is never handed out.
    live = select(models.Experiment.id).where(models.Experiment.state.not_in([s.value for s in EXPERIMENT_FINAL]))
    wanted = [candidate.kind.in_(list(kinds)), candidate.experiment_id.in_(live)]
    agent_id = None if agent is None else agent.id
    return await _join_gang(session, candidate, agent_id, wanted) or await _take_queued(
        session, candidate, agent_id, wanted
    )


async def _join_gang(
    session: AsyncSession,
    candidate: type[models.Job],
    agent_id: uuid.UUID | None,
    wanted: Sequence[ColumnElement[bool]],
) -> uuid.UUID | None:
    """Take an open rank of a gang the agent is not already in."""
    mine = (
        select(models.Attempt.id)
        .where(
            models.Attempt.job_id == candidate.id,
            models.Attempt.number == candidate.attempts_made,
            models.Attempt.agent_id.is_(None) if agent_id is None else models.Attempt.agent_id == agent_id,
        )
        .exists()
    )
    # A retry's rank goes back to the host that held it in the generation before (each rank resumes from its own
    # checkpoints: a DiLoCo worker's optimizer is its own); a rank nobody held there is open to any host.
    previous = aliased(models.Attempt, name="previous")
    held_by_another = (
        select(previous.id)
        .where(
            previous.job_id == candidate.id,
            previous.number == candidate.attempts_made - 1,
            previous.rank == candidate.world_size - candidate.ranks_open,
            previous.agent_id.is_not(None) if agent_id is None else previous.agent_id != agent_id,
        )
        .exists()
    )
    open_gang = (
        select(candidate.id)
        .where(candidate.state.in_(ACTIVE), candidate.ranks_open > 0, ~mine, ~held_by_another, *wanted)
        .order_by(candidate.queued_at, candidate.id)
        .limit(1)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    # The state is checked again here: on Postgres a claim that waited on the row lock of a gang the
    # reaper just requeued re-reads the row, and must not join it as a rank of a generation that ended.
    joined = await session.execute(
        update(models.Job)
        .where(models.Job.id == open_gang, models.Job.ranks_open > 0, models.Job.state.in_(ACTIVE))
        .values(ranks_open=models.Job.ranks_open - 1, updated_at=_now())
        .returning(models.Job.id)
        .execution_options(synchronize_session=False)
    )
    return joined.scalar_one_or_none()


async def _take_queued(
    session: AsyncSession,
    candidate: type[models.Job],
    agent_id: uuid.UUID | None,
    wanted: Sequence[ColumnElement[bool]],
) -> uuid.UUID | None:
    """Lease a queued job the agent may claim (rank 0 of a gang), the first queued first."""
    now = _now()
    queued = (
        select(candidate.id)
        .where(
            candidate.state == J.QUEUED.value,
            or_(candidate.pinned_agent_id.is_(None), candidate.pinned_agent_id == agent_id),
            *wanted,
        )
        .order_by(candidate.queued_at, candidate.id)
        .limit(1)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    taken = await session.execute(
        update(models.Job)
        .where(models.Job.id == queued, models.Job.state == J.QUEUED.value)
        .values(
            state=lifecycle.leased_state().value,
            attempts_made=models.Job.attempts_made + 1,
            ranks_open=models.Job.world_size - 1,
            master_addr=None,
            master_port=None,
            updated_at=now,
        )
        .returning(models.Job.id)
        .execution_options(synchronize_session=False)
    )
    return taken.scalar_one_or_none()


def _lease(settings: Settings, attempt: models.Attempt) -> str:
    """A new lease token for the attempt (only its hash is kept) and a full lease term from now."""
    token = secrets.token_urlsafe(32)
    attempt.lease_token_hash = hash_secret(token)
    attempt.lease_expires_at = _now() + datetime.timedelta(seconds=settings.lease_seconds)
    return token


def _assignment(job: models.Job, attempt: models.Attempt, token: str) -> wire.Assignment:
    return wire.Assignment(
        job_id=job.id,
        attempt_id=attempt.id,
        experiment_id=job.experiment_id,
        kind=job.kind,  # type: ignore[arg-type]
        arm=job.arm,
        role=job.role,  # type: ignore[arg-type]
        spec=job.spec,
        number=attempt.number,
        rank=attempt.rank,
        world_size=job.world_size,
        master_addr=attempt.master_addr,
        master_port=attempt.master_port,
        lease_token=token,
        lease_expires_at=attempt.lease_expires_at,
    )


async def _claimed_before(
    session: AsyncSession, settings: Settings, agent: models.Agent, claim_key: str
) -> wire.Assignment | Literal[False] | None:
    """The attempt a retried claim was given the first time (its reply was lost), with a new lease token;
    None when that attempt has ended since; False when the key is new."""
    attempt = await session.scalar(
        select(models.Attempt)
        .where(models.Attempt.agent_id == agent.id, models.Attempt.claim_key == claim_key)
        .with_for_update()
    )
    if attempt is None:
        return False
    if attempt.state != J.LEASED.value:
        return None  # ended (or started, which its agent would have needed the first reply for)
    job = await session.get_one(models.Job, attempt.job_id)
    return _assignment(job, attempt, _lease(settings, attempt))


async def claim(
    session: AsyncSession,
    settings: Settings,
    agent: models.Agent | None,
    kinds: Sequence[str],
    claim_key: str | None = None,
) -> wire.Assignment | None:
    """One claim of a job of one of ``kinds``, in the session's current transaction; the caller commits. ``agent``
    None is the coordinator's own worker (server.reporter). A claim key seen before from this agent gets the
    attempt of its first claim again, never a second one."""
    if agent is not None and claim_key is not None:
        earlier = await _claimed_before(session, settings, agent, claim_key)
        if earlier is not False:
            return earlier
    job_id = await _claim_row(session, agent, kinds)
    if job_id is None:
        return None
    job = await session.get_one(models.Job, job_id, populate_existing=True)
    rank = job.world_size - job.ranks_open - 1
    now = _now()
    if rank == 0 and job.world_size > 1 and agent is not None:
        job.master_addr = agent.private_address or agent.address  # the gang meets on the private link
        job.master_port = rendezvous_port(settings, job.id, job.attempts_made)
        job.formation_deadline = now + datetime.timedelta(seconds=settings.gang_form_seconds)
    if job.ranks_open == 0:
        job.formation_deadline = None
    else:
        claims.claimable(session)  # the gang's other ranks are open to other agents
    attempt = models.Attempt(
        job_id=job.id,
        number=job.attempts_made,
        rank=rank,
        agent_id=None if agent is None else agent.id,
        state=J.LEASED.value,
        claim_key=claim_key,
        master_addr=job.master_addr,
        master_port=job.master_port,
    )
    token = _lease(settings, attempt)
    session.add(attempt)
    await session.flush()
    lifecycle.record_claim(session, job, attempt)
    return _assignment(job, attempt, token)


async def _settle(session: AsyncSession, job: models.Job, ended: models.Attempt) -> Ended:
    """Bring the job in line with an attempt that just ended: a gang ends together; a lost job is retried."""
    if ended.number == job.attempts_made:  # else an attempt of an earlier generation: its job has moved on
        await _settle_generation(session, job, ended)
    return Ended(job, ended, J(job.state))


async def _settle_generation(session: AsyncSession, job: models.Job, ended: models.Attempt) -> None:
    generation_ = await generation(session, job)
    outcome = J(ended.state)
    if outcome in {J.LOST, J.FAILED, J.CANCELLED}:
        running = [sibling for sibling in generation_ if sibling.state in ACTIVE]
        if outcome == J.FAILED and running and job.cancel_requested_at is None:
            # A gang rank fails when a peer's host vanishes (its collective breaks). Whether this generation
            # was lost or failed is known once every rank ended: the peers still running finish or fail on
            # their own, and a vanished one's lease expires (lost, so the job is retried).
            return
        if any(sibling.state == J.LOST.value for sibling in generation_):
            outcome = J.LOST
        for sibling in running:
            if sibling.state in ACTIVE:
                lifecycle.move_attempt(
                    session,
                    job,
                    sibling,
                    J.CANCELLED,
                    f"rank {ended.rank} {outcome.value}: the ranks of a gang end together",
                )
        job.ranks_open, job.formation_deadline = 0, None
        if J(job.state) in JOB_FINAL:
            return
        target = J.CANCELLED if job.cancel_requested_at is not None else outcome
        lifecycle.move_job(session, job, target, f"rank {ended.rank} of attempt {ended.number} {outcome.value}")
        tried = job.attempts_made - job.formation_timeouts
        if target == J.LOST and tried < job.max_attempts:
            lifecycle.move_job(session, job, J.QUEUED, f"retry {tried + 1} of {job.max_attempts}")
            job.ranks_open, job.master_addr, job.master_port = job.world_size, None, None
            if job.world_size > 1:
                # Each rank resumes from its own checkpoints: the retry's rank 0 is claimed on rank 0's host.
                job.pinned_agent_id = next(a.agent_id for a in generation_ if a.rank == 0)
        return
    if job.ranks_open == 0 and all(a.state == J.SUCCEEDED.value for a in generation_):
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


async def reap(session: AsyncSession, settings: Settings) -> list[Ended]:
    """Turn expired leases into ``lost``, overdue cancellations into ``cancelled`` and requeue gangs that did
    not form; returns the attempts it ended."""
    now = _now()
    expired = list(
        await session.scalars(
            select(models.Attempt)
            .where(models.Attempt.state.in_(ACTIVE), models.Attempt.lease_expires_at < now)
            .order_by(models.Attempt.id)
            .with_for_update(skip_locked=True)
        )
    )
    overdue = list(
        await session.scalars(
            select(models.Attempt)
            .where(models.Attempt.state.in_(ACTIVE), models.Attempt.cancel_deadline < now)
            .order_by(models.Attempt.id)
            .with_for_update(skip_locked=True)
        )
    )
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
    return int(renewed.rowcount or 0)  # type: ignore[attr-defined]


async def owned_attempt(
    session: AsyncSession, agent: models.Agent | None, attempt_id: uuid.UUID, lease_token: str | None
) -> tuple[models.Job, models.Attempt]:
    """The attempt and its job, if this agent (None: the coordinator) holds it (and, when given, the lease token
    matches)."""
    attempt = await session.get(models.Attempt, attempt_id, with_for_update=True)
    if attempt is None:
        raise NotFound(f"attempt {attempt_id} does not exist")
    if attempt.agent_id != (None if agent is None else agent.id):
        raise Forbidden(f"attempt {attempt_id} is leased to another agent; an agent acts only on its own leases")
    if lease_token is not None and not secrets.compare_digest(attempt.lease_token_hash, hash_secret(lease_token)):
        raise Forbidden(f"the lease token does not match attempt {attempt_id}")
    job = await session.get_one(models.Job, attempt.job_id, with_for_update=True)
    return job, attempt


def require_active(attempt: models.Attempt) -> None:
    if attempt.state not in ACTIVE:
        raise Refused(
            "attempt-already-ended",
            f"attempt {attempt.id} is {attempt.state} ({attempt.reason}); stop it and claim new work",
        )


async def start(
    session: AsyncSession, agent: models.Agent | None, attempt_id: uuid.UUID, lease_token: str
) -> models.Attempt:
    job, attempt = await owned_attempt(session, agent, attempt_id, lease_token)
    require_active(attempt)
    if attempt.state == J.LEASED.value:
        lifecycle.move_attempt(session, job, attempt, J.RUNNING, "the agent started the command")
    if job.state == J.LEASED.value:
        lifecycle.move_job(session, job, J.RUNNING, f"rank {attempt.rank} started")
    return attempt


async def finish(
    session: AsyncSession,
    job: models.Job,
    attempt: models.Attempt,
    outcome: wire.Outcome,
    *,
    exit_code: int | None = None,
    reason: str | None = None,
    result: dict[str, Any] | None = None,
) -> Ended:
    """End an attempt as its agent (or the coordinator) reports; the caller checked ownership (``owned_attempt``)
    and the result (its job kind's, untagged)."""
    require_active(attempt)
    attempt.exit_code, attempt.result = exit_code, result or {}
    lifecycle.move_attempt(session, job, attempt, J(outcome), reason or f"the agent reported {outcome}")
    return await _settle(session, job, attempt)


async def heartbeat(
    session: AsyncSession,
    settings: Settings,
    agent: models.Agent,
    attempt_ids: Sequence[uuid.UUID],
    claiming: str | None = None,
) -> tuple[wire.HeartbeatReply, list[Ended]]:
    """Renew the leases this agent names and tell it, per attempt named, whether to go on.

    An active attempt of the agent that it does not name, and whose claim is not the one it has in flight, is
    not held by it (its result was refused, its claim reply lost, or it restarted): it ends lost and is retried.
    Only attempts claimed before the agent's previous heartbeat was answered are judged, so that a heartbeat
    sent before a claim was made, and answered after, takes nothing away. An agent heartbeats one at a time."""
    now = _now()
    expires = now + datetime.timedelta(seconds=settings.lease_seconds)
    previous, agent.last_seen_at = agent.last_seen_at, now
    named = set(attempt_ids)
    ended = []
    held = await session.scalars(
        select(models.Attempt)
        .where(models.Attempt.agent_id == agent.id, models.Attempt.state.in_(ACTIVE))
        .order_by(models.Attempt.id)
        .with_for_update()
    )
    for active in list(held):
        if active.id in named or (claiming is not None and active.claim_key == claiming):
            active.lease_expires_at = expires
        elif active.created_at < previous:
            job = await session.get_one(models.Job, active.job_id, with_for_update=True)
            lifecycle.move_attempt(session, job, active, J.LOST, NOT_HELD)
            ended.append(await _settle(session, job, active))
    directives = []
    for attempt_id in attempt_ids:
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
    state = J(job.state)
    if state in JOB_FINAL:
        raise Refused("job-already-finished", f"job {job.id} is already {state.value}")
    if state == J.QUEUED:
        lifecycle.move_job(session, job, J.CANCELLED, "cancelled by the operator before any claim")
        return [Ended(job, None, J.CANCELLED)]
    now = _now()
    job.cancel_requested_at = now
    job.ranks_open = 0
    deadline = now + datetime.timedelta(seconds=grace_seconds)
    for attempt in await generation(session, job):
        if J(attempt.state) in JOB_ACTIVE:
            attempt.cancel_deadline = deadline
    return []
