"""The experiment and job state machines.

Every status change in the coordinator goes through ``move_experiment``, ``move_job`` or ``move_attempt``;
each checks the transition table, assigns the state and records the change as an event row. A request that breaks a
rule is ``Refused``, naming the rule (the API answers 409); the experiment's own rules, the guards, are the
protocol's (server/protocol/guards.py).
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core.errors import CoopError
from experiment.core.states import ExperimentState, JobState
from experiment.wire import Outcome
from server import models
from server.dispatch import waiters


class Refused(CoopError):
    """A request the protocol forbids; ``rule`` names the rule (stable, for clients and tests)."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(detail)
        self.rule = rule
        self.detail = detail


E = ExperimentState
J = JobState

_FORWARD: dict[ExperimentState, ExperimentState] = {
    E.DRAFT: E.COMMITTED,
    E.COMMITTED: E.PREPARED,
    E.PREPARED: E.TRAINING,
    E.TRAINING: E.TRAINED,
    E.TRAINED: E.SELECTED,
    E.SELECTED: E.TESTED,
    E.TESTED: E.SERVING,
    E.SERVING: E.REPORTED,
}
# A plan that serves no arm (the local-SGD design) is reported once it is tested (guard_report says which).
_SKIPS: dict[ExperimentState, ExperimentState] = {E.TESTED: E.REPORTED}
EXPERIMENT_FINAL = frozenset({E.REPORTED, E.FAILED, E.HALTED})
EXPERIMENT_TRANSITIONS: dict[ExperimentState, frozenset[ExperimentState]] = {
    state: frozenset(
        ({_FORWARD[state]} if state in _FORWARD else set())
        | ({_SKIPS[state]} if state in _SKIPS else set())
        | ({E.FAILED, E.HALTED} if state not in EXPERIMENT_FINAL else set())
    )
    for state in ExperimentState
}

JOB_FINAL = frozenset({J.SUCCEEDED, J.FAILED, J.LOST, J.CANCELLED})
JOB_ACTIVE = frozenset({J.LEASED, J.RUNNING})
# Retries: only ``lost`` goes back to the queue (bounded by the job's max_attempts). ``lost`` says the
# host or agent vanished, which a second try can cure. ``failed`` is final: the command itself exited
# non-zero (a refused input, a digest disagreement, a non-finite loss), and running the same deterministic
# command again would fail again, or, worse, turn a test evaluation into a re-roll. The operator reads the
# reason and queues a new job after fixing the cause.
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    J.QUEUED: frozenset({J.LEASED, J.CANCELLED}),
    # Back to the queue from leased or running only when a gang did not form in time (no rank ran with
    # its peers); that requeue does not use up a retry.
    J.LEASED: frozenset({J.QUEUED, J.RUNNING, J.SUCCEEDED, J.FAILED, J.LOST, J.CANCELLED}),
    J.RUNNING: frozenset({J.QUEUED, J.SUCCEEDED, J.FAILED, J.LOST, J.CANCELLED}),
    J.SUCCEEDED: frozenset(),
    J.FAILED: frozenset(),
    # A lost job is retried by queueing it again; the retry is a new attempt row.
    J.LOST: frozenset({J.QUEUED}),
    J.CANCELLED: frozenset(),
}
# What an agent reports about an attempt it ends (wire.Outcome), as the attempt's state.
ENDED_AS: dict[Outcome, JobState] = {
    "succeeded": J.SUCCEEDED,
    "failed": J.FAILED,
    "cancelled": J.CANCELLED,
    "lost": J.LOST,
}
# An attempt is one lease of one rank; it never goes back to the queue.
ATTEMPT_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    state: targets - {J.QUEUED} for state, targets in JOB_TRANSITIONS.items()
}


def experiment_target(state: ExperimentState, target: ExperimentState) -> ExperimentState:
    if target not in EXPERIMENT_TRANSITIONS[state]:
        raise Refused(
            "experiment-transition",
            f"the experiment is {state}; it cannot become {target} (allowed next: "
            f"{', '.join(sorted(EXPERIMENT_TRANSITIONS[state])) or 'none, it is final'})",
        )
    return target


def job_target(
    state: JobState, target: JobState, table: Mapping[JobState, frozenset[JobState]] = JOB_TRANSITIONS
) -> JobState:
    if target not in table[state]:
        raise Refused("job-transition", f"a {state} job or attempt cannot become {target}")
    return target


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _state_row(
    *,
    experiment_id: uuid.UUID | None,
    job_id: uuid.UUID | None,
    attempt_id: uuid.UUID | None,
    subject: str,
    before: str,
    after: str,
    reason: str,
) -> dict[str, Any]:
    """A state event's row: which thing moved, from and to which state, and why."""
    return {
        "experiment_id": experiment_id,
        "job_id": job_id,
        "attempt_id": attempt_id,
        "kind": "state",
        "at": _now(),
        "body": {"subject": subject, "from": before, "to": after, "reason": reason},
    }


def _state_event(session: AsyncSession, row: dict[str, Any]) -> None:
    session.add(models.Event(**row))


def move_experiment(session: AsyncSession, experiment: models.Experiment, target: ExperimentState, reason: str) -> None:
    before = experiment.state
    experiment.state = experiment_target(before, target)
    _state_event(
        session,
        _state_row(
            experiment_id=experiment.id,
            job_id=None,
            attempt_id=None,
            subject="experiment",
            before=before,
            after=target,
            reason=reason,
        ),
    )


def move_job(session: AsyncSession, job: models.Job, target: JobState, reason: str) -> None:
    before = job.state
    job.state = job_target(before, target)
    if target == JobState.QUEUED:
        waiters.claimable(session)
    _state_event(
        session,
        _state_row(
            experiment_id=job.experiment_id,
            job_id=job.id,
            attempt_id=None,
            subject="job",
            before=before,
            after=target,
            reason=reason,
        ),
    )


def move_attempt(
    session: AsyncSession, job: models.Job, attempt: models.Attempt, target: JobState, reason: str
) -> None:
    before = attempt.state
    attempt.state = job_target(before, target, ATTEMPT_TRANSITIONS)
    if target in JOB_FINAL:
        attempt.finished_at = _now()
        attempt.reason = reason
    _state_event(
        session,
        _state_row(
            experiment_id=job.experiment_id,
            job_id=job.id,
            attempt_id=attempt.id,
            subject="attempt",
            before=before,
            after=target,
            reason=reason,
        ),
    )


def leased_state() -> JobState:
    """The state a claim gives a queued job (the claim itself is one SQL statement in queue.py)."""
    return job_target(J.QUEUED, J.LEASED)


# An events row (a state event, or an event batch's rows) written without an ORM object.
NEW_EVENT = insert(models.Event.metadata.tables["events"])


def claim_event(
    experiment_id: uuid.UUID, job_id: uuid.UUID, attempt_id: uuid.UUID, rank: int, number: int
) -> dict[str, Any]:
    """The state event of a claim, as the row's values (the claim writes it with one Core INSERT)."""
    return _state_row(
        experiment_id=experiment_id,
        job_id=job_id,
        attempt_id=attempt_id,
        subject="attempt",
        before=J.QUEUED,
        after=J.LEASED,
        reason=f"claimed rank {rank} of attempt {number}",
    )


# Guards ----------------------------------------------------------------------------------------
