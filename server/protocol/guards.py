"""The experiment's rules for queueing a job and for what a commitment may say: pure functions of the experiment's
state, ledger and plan that raise ``Refused`` naming the rule a request broke (the API answers 409). Each job kind's
guard is its entry's in ``kinds.TABLE``; the selection and serving guards are the recording's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from experiment.core.plan import Plan
from experiment.core.states import ExperimentState
from server.dispatch.lifecycle import EXPERIMENT_FINAL, Refused
from server.store.commitments import Ledger

E = ExperimentState


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


def unguarded(job: Proposal) -> None:
    """A kind with no rule of its own (guard_job's alone)."""


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
    if arm is not None and arm in plan.arm_names() and plan.arm_plan(arm).damaged:
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
