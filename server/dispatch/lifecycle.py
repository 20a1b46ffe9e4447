"""The experiment and job state machines and the protocol's guards.

Every status change in the coordinator goes through ``move_experiment``, ``move_job`` or ``move_attempt``;
each checks the transition table, assigns the state and records the change as an event row. The guards
are pure functions that raise ``Refused`` naming the rule a request broke (the API answers 409).
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core.errors import CoopError
from experiment.core.plan import Plan
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


@dataclass(frozen=True)
class Ledger:
    """What the experiment's ledger commits so far (kind -> identity)."""

    committed: Mapping[str, str]

    def has(self, entry: str) -> bool:
        return entry in self.committed


@dataclass(frozen=True)
class Proposal:
    """A job someone asks to queue, with what its guards read: the experiment's state, ledger and plan."""

    kind: str
    state: ExperimentState
    ledger: Ledger
    plan: Plan
    arm: str | None
    role: str | None


def guard_job(job: Proposal, *, needs_arm: bool) -> None:
    """What every job must meet before its kind's own guard: a live experiment, and an arm its plan has."""
    if job.state in EXPERIMENT_FINAL:
        raise Refused("experiment-final", f"the experiment is {job.state}; it takes no new jobs")
    if needs_arm and job.arm is None:
        raise Refused("job-needs-arm", f"a {job.kind} job names its arm")
    if job.arm is not None and job.arm not in job.plan.arm_names():
        arms = ", ".join(job.plan.arm_names())
        raise Refused("arm-not-in-plan", f"plan {job.plan.name} has no arm {job.arm}; its arms are {arms}")


def guard_canary(job: Proposal) -> None:
    """The canary tries the real hosts before the plan is committed: only a draft takes one."""
    if job.state != E.DRAFT:
        raise Refused(
            "canary-requires-draft", f"a canary runs before the plan is committed; the experiment is {job.state}"
        )


def guard_prepare(job: Proposal) -> None:
    """Prepare is queued when the plan is committed (and again after one failed)."""


def guard_train(job: Proposal) -> None:
    trained = job.plan.trained_arms()
    if job.arm not in trained:
        raise Refused("train-arm", f"only {', '.join(trained)} are trained, not {job.arm}")
    if not job.ledger.has("prepared"):
        raise Refused(
            "training-requires-committed-prepared-identity",
            "no training before the prepared identity is committed: run and record the prepare job first",
        )


def guard_evaluate(job: Proposal) -> None:
    if job.role not in {"dev", "test"}:
        raise Refused("evaluate-role", "an evaluate job names its role: dev or test")
    if job.role == "test" and not job.ledger.has("selection"):
        raise Refused(
            "test-evaluation-requires-committed-selection",
            "no test evaluation before the selection is committed: select the final checkpoints first",
        )
    trained = {E.TRAINED, E.SELECTED, E.TESTED, E.SERVING}
    if job.role == "dev" and job.arm in job.plan.trained_arms() and job.state not in trained:
        raise Refused("dev-evaluation-requires-trained-arms", "dev evaluation of a trained arm waits for training")


def guard_select(job: Proposal) -> None:
    trained = job.plan.trained_arms()
    if job.arm not in trained:
        raise Refused("select-arm", f"only the trained arms {', '.join(trained)} are selected, not {job.arm}")
    if job.state != E.TRAINED:
        raise Refused("select-requires-trained-arms", f"selection follows training; the experiment is {job.state}")


def guard_replica_job(job: Proposal) -> None:
    """A replica serves the served arm's selected final checkpoint: it may start once the selection is committed
    (beside the test evaluations, which it does not read)."""
    guard_serving_arm(job.plan, job.arm)
    if job.state not in {E.SELECTED, E.TESTED, E.SERVING}:
        raise Refused("replica-requires-committed-selection", "a replica serves a committed selection's checkpoint")


def guard_benchmark(job: Proposal) -> None:
    guard_serving_arm(job.plan, job.arm)
    if job.state != E.SERVING:
        raise Refused("serving-requires-serving-commitment", "benchmarks wait for the serving commitment")


def report_state(plan: Plan) -> ExperimentState:
    """The state a report is computed in: after the serving phase, or after the test evaluations of a plan that
    serves no arm."""
    return E.SERVING if plan.serves() else E.TESTED


def report_follows(plan: Plan) -> str:
    """What the report waits for, in words (for refusals)."""
    return "the serving phase" if plan.serves() else "the test evaluations"


def guard_report(job: Proposal) -> None:
    if job.state != report_state(job.plan):
        raise Refused(
            "report-requires-test-evaluations", f"the report follows {report_follows(job.plan)}; now {job.state}"
        )


@dataclass(frozen=True)
class TrainedArm:
    name: str
    final_step: int | None
    model_identity: str | None


def guard_selection(
    plan: Plan, arms: Mapping[str, TrainedArm], chosen: Mapping[str, tuple[int | None, str]], final_step: int
) -> None:
    """Selection takes each trained arm's verified final checkpoint: all three, final step only, never a score."""
    trained = plan.trained_arms()
    unknown = sorted(set(chosen) - set(trained))
    if unknown:
        raise Refused("selection-trained-arms-only", f"{', '.join(unknown)} cannot be selected; arms: {trained}")
    missing = [arm for arm in trained if arm not in chosen]
    if missing:
        raise Refused("selection-requires-all-three-arms", f"the selection lacks {', '.join(missing)}")
    for name in trained:
        step, model_identity = chosen[name]
        recorded = arms[name]
        if recorded.final_step is None or recorded.model_identity is None:
            raise Refused("selection-requires-verified-final-checkpoints", f"{name} has no verified final checkpoint")
        if step != final_step:
            raise Refused(
                "selection-final-checkpoints-only",
                f"{name}: step {step} is not the final step {final_step}; only final checkpoints are eligible",
            )
        if model_identity != recorded.model_identity:
            raise Refused(
                "selection-must-match-verified-checkpoint",
                f"{name}: model identity {model_identity[:12]}... is not the verified final checkpoint "
                f"{recorded.model_identity[:12]}...",
            )


def guard_serving_arm(plan: Plan, arm: str | None) -> None:
    """Only the plan's served arm is served; the damaged arm never is (the rule names keep the reference's arms)."""
    if arm is not None and arm in plan.arm_names() and plan.role_of(arm) == "damaged":
        raise Refused("damaged-arm-never-served", "the damaged arm is never eligible for serving")
    if not plan.serves():
        raise Refused("plan-serves-no-arm", f"plan {plan.name} ({plan.design()} design) serves no arm")
    served = plan.served_arm()
    if arm != served:
        raise Refused("serving-clean-pair-only", f"only the {served} final checkpoint is served, not {arm}")


def guard_serving(plan: Plan, arm: str, model_identity: str, selected: Mapping[str, Any]) -> None:
    guard_serving_arm(plan, arm)
    served = plan.served_arm()
    chosen = selected.get(served)
    if not isinstance(chosen, Mapping) or chosen.get("model_identity") != model_identity:
        raise Refused(
            "serving-selected-final-checkpoint-only",
            f"serving loads the {served} final checkpoint named by the committed selection, and no other",
        )
