"""What an experiment is: its states in order, each with what enters it, the jobs it queues and the commitment it
makes. Read top to bottom, ``TABLE`` is the protocol; ``phases.progress`` moves an experiment by it and nothing else
decides an experiment's next step.

    state      entered by                          queues (stage after stage)           makes
    draft      its creation from a plan            (a canary, by the operator)          the plan, once committed
    committed  the plan's commitment               prepare
    prepared   the prepared inputs' commitment     train each trained arm
    training   its train jobs queued               (the same stage, until it succeeded)
    trained    every train job succeeded           dev evaluations; then a select job   selection, from the select
                                                   per trained arm                      jobs' verified checkpoints
    selected   the selection's commitment          test evaluations (and the served      tested, from the test
                                                   arm's replicas, one a pair host)      evaluations
    tested     the test results' commitment        the report (a plan that serves none)  serving, when advanced
    serving    the serving commitment              replicas, benchmark phases, replica
                                                   stops, the report
    reported   the report's commitment

The guards: a job meets its kind's guard (``kinds.TABLE``, keyed by kind, the rules of ``guards.py``) when it is
queued, by this table or by an operator; a commitment meets its own where it is recorded (``recording``: the
selection's and the serving's). The transitions that a halt or a failure takes are the state machine's
(``dispatch.lifecycle``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from experiment import wire
from experiment.core.plan import Plan
from experiment.core.states import ExperimentState, JobState
from experiment.serving.servingrecord import PHASES
from server import models
from server.dispatch.lifecycle import EXPERIMENT_FINAL, EXPERIMENT_TRANSITIONS, JOB_ACTIVE
from server.store.commitments import Ledger

E = ExperimentState
J = JobState


def label(kind: str, arm: str | None, role: str | None) -> str:
    """``train clean-pair``, ``evaluate test seed``."""
    return " ".join(part for part in (kind, role, arm) if part)


@dataclass(frozen=True)
class Order:
    """A job to queue: its kind's spec, and the arm and role it is for."""

    spec: wire.JobSpec
    arm: str | None = None
    role: str | None = None

    @property
    def kind(self) -> wire.JobKind:
        return wire.kind_of(self.spec)

    def matches(self, job: models.Job) -> bool:
        """The job was queued for this order (a job's spec may hold more, filled in when it was placed)."""
        same = (job.kind, job.arm, job.role) == (self.kind, self.arm, self.role)
        return same and all(job.spec.get(key) == value for key, value in wire.untagged(self.spec).items())

    def __str__(self) -> str:
        details = (f"{key} {value}" for key, value in wire.untagged(self.spec).items())
        return " ".join([label(self.kind, self.arm, self.role), *details])


REPORT = Order(wire.ReportSpec())
Stages = list[list[Order]]


# What enters a state.
@dataclass(frozen=True)
class Committed:
    """The ledger holds this commitment."""

    commitment: str


@dataclass(frozen=True)
class Queued:
    """A job of this kind is queued."""

    kind: wire.JobKind


@dataclass(frozen=True)
class Completed:
    """Every job the state before queued has succeeded."""


@dataclass(frozen=True)
class Makes:
    """The commitment a state makes: from its succeeded jobs of ``kind`` and ``role`` once they all succeeded, or,
    with ``kind`` None, when the operator (or autopilot) advances."""

    commitment: str
    kind: wire.JobKind | None = None
    role: str | None = None


def _nothing(plan: Plan) -> Stages:
    return []


def _prepare(plan: Plan) -> Stages:
    return [[Order(wire.PrepareSpec())]]


def _training(plan: Plan) -> Stages:
    return [[Order(wire.TrainSpec(), arm) for arm in plan.trained_arms()]]


def _dev_then_select(plan: Plan) -> Stages:
    return [
        [Order(wire.EvaluateSpec(), arm, "dev") for arm in plan.arm_names()],
        [Order(wire.SelectSpec(), arm) for arm in plan.trained_arms()],
    ]


def _replicas(plan: Plan) -> list[Order]:
    served = plan.served_arm()
    return [Order(wire.ReplicaStartSpec(rank=rank), served) for rank in range(plan.world_size(served))]


def _tests(plan: Plan) -> Stages:
    """The test evaluations; a served arm's replicas start beside them (queued after them, so that a host
    evaluates first), since they need the selection only."""
    tests = [Order(wire.EvaluateSpec(), arm, "test") for arm in plan.arm_names()]
    return [[*tests, *_replicas(plan)]] if plan.serves() else [tests]


def _report_unless_served(plan: Plan) -> Stages:
    """A plan that serves no arm (the local-SGD design) is reported once tested."""
    return [] if plan.serves() else [[REPORT]]


def _serving(plan: Plan) -> Stages:
    """A replica on each host of the pair where none was started, the benchmark phases (the failure phase stops
    rank 1's replica midway: replicas.py), both replicas stopped, then the report (none in a plan that serves no
    arm, which never serves)."""
    if not plan.serves():
        return []
    served = plan.served_arm()
    stops = [Order(wire.ReplicaStopSpec(rank=rank), served) for rank in range(plan.world_size(served))]
    benchmarks = [[Order(wire.BenchmarkSpec(phase=phase), served)] for phase in PHASES]
    return [_replicas(plan), *benchmarks, stops, [REPORT]]


@dataclass(frozen=True)
class State:
    """One row of the protocol: the state, what enters it and the reason its entry records, the stages it queues
    from the plan, and the commitment it makes (None: the next state is entered by another's)."""

    state: ExperimentState
    entered: Committed | Queued | Completed | None
    because: str
    queues: Callable[[Plan], Stages]
    makes: Makes | None = None


# The commitments a state makes: the plan (the operator's commit of a draft, past the canary gate: phases.commit), the
# selection from the select jobs' verified checkpoints, the test results from the test evaluations, and, in a plan that
# serves an arm, the serving commitment when the tested experiment is advanced (the local-SGD design's report follows
# its test results).
PLAN = Makes("plan")
SELECTION = Makes("selection", "select")
TEST_RESULTS = Makes("tested", "evaluate", "test")
SERVED = Makes("serving")

TABLE: tuple[State, ...] = (
    State(E.DRAFT, None, "created from its plan", _nothing, PLAN),
    State(E.COMMITTED, Committed("plan"), "plan committed", _prepare),
    State(E.PREPARED, Committed("prepared"), "prepared inputs committed", _training),
    State(E.TRAINING, Queued("train"), "training queued", _training),
    State(E.TRAINED, Completed(), "every arm has a verified final checkpoint", _dev_then_select, SELECTION),
    State(E.SELECTED, Committed("selection"), "final checkpoints selected", _tests, TEST_RESULTS),
    State(E.TESTED, Committed("tested"), "every arm was evaluated on the test role", _report_unless_served, SERVED),
    State(E.SERVING, Committed("serving"), "serving committed", _serving),
    State(E.REPORTED, Committed("report"), "report recorded", _nothing),
)
ROW: dict[ExperimentState, State] = {row.state: row for row in TABLE}
# The state each commitment lets the experiment enter (recording.commit refuses one whose state may not come next).
ENTERS: dict[str, ExperimentState] = {
    row.entered.commitment: row.state for row in TABLE if isinstance(row.entered, Committed)
}


def stages(plan: Plan, state: ExperimentState) -> Stages:
    """The state's jobs as stages in order: a stage is queued once the one before it has succeeded (none for a
    state off the table: halted)."""
    row = ROW.get(state)
    return [] if row is None else row.queues(plan)


def makes(plan: Plan, state: ExperimentState) -> Makes | None:
    """The commitment the state makes (the serving commitment only in a plan that serves an arm)."""
    row = ROW.get(state)
    made = None if row is None else row.makes
    return None if made is SERVED and not plan.serves() else made


@dataclass(frozen=True)
class Standing:
    """What the experiment stands on now, read at once: its state, plan, jobs and ledger."""

    state: ExperimentState
    plan: Plan
    jobs: list[models.Job]
    ledger: Ledger

    def busy(self) -> list[models.Job]:
        return [job for job in self.jobs if job.state in {J.QUEUED, *JOB_ACTIVE}]

    def succeeded(self, orders: list[Order]) -> list[models.Job] | None:
        """The job that succeeded for each order, or None while one has not."""
        done = [next((j for j in self.jobs if o.matches(j) and j.state == J.SUCCEEDED), None) for o in orders]
        found = [job for job in done if job is not None]
        return found if len(found) == len(orders) else None

    def stages(self) -> Stages:
        return stages(self.plan, self.state)

    def next_stage(self) -> list[Order]:
        """The first stage of the phase that is not done: those of its orders that have no succeeded job."""
        for stage in self.stages():
            missing = [order for order in stage if self.succeeded([order]) is None]
            if missing:
                return missing
        return []


# The steps that move an experiment, each decided from its standing alone.
@dataclass(frozen=True)
class Enter:
    """The state the experiment enters, and why (the reason its state event records)."""

    state: ExperimentState
    reason: str


@dataclass(frozen=True)
class Commit:
    """The commitment the next state stands on: made from the jobs of the stage that queued them (selection:
    the select jobs' verified checkpoints; tested: the test evaluations), or with no job (serving)."""

    kind: str
    jobs: list[models.Job]


@dataclass(frozen=True)
class Queue:
    orders: list[Order]


@dataclass(frozen=True)
class Wait:
    """No step to take now, and why (an operator's advance is refused with it)."""

    rule: str
    detail: str


Step = Enter | Commit | Queue


def _holds(entry: Committed | Queued | Completed | None, standing: Standing) -> bool:
    """What enters a state (its row's ``entered``) holds where the experiment stands."""
    if isinstance(entry, Committed):
        return standing.ledger.has(entry.commitment)
    if isinstance(entry, Queued):
        return any(job.kind == entry.kind for job in standing.jobs)
    if isinstance(entry, Completed):
        return standing.succeeded([order for stage in standing.stages() for order in stage]) is not None
    return False


def entered(standing: Standing) -> Step | None:
    """The state the experiment enters now (the first next state whose row's entry holds), or the commitment its
    state's jobs make to enter it; None while its phase is not complete."""
    made = makes(standing.plan, standing.state)
    if made is not None and made.kind is not None and not standing.ledger.has(made.commitment):
        orders = [o for stage in standing.stages() for o in stage if (o.kind, o.role) == (made.kind, made.role)]
        jobs = standing.succeeded(orders)
        return None if jobs is None else Commit(made.commitment, jobs)
    for target in sorted(EXPERIMENT_TRANSITIONS[standing.state]):
        row = ROW.get(target)
        if row is not None and _holds(row.entered, standing):
            return Enter(target, row.because)
    return None


def driven(standing: Standing, *, retry: bool) -> Step | Wait:
    """What advancing does now: the serving commitment once tested, else the next stage's missing jobs. Only the
    operator retries (``retry``): autopilot waits where a job of the stage ended without success."""
    state = standing.state
    if state in {E.DRAFT, *EXPERIMENT_FINAL}:
        return Wait("experiment-final", f"the experiment is {state}; there is nothing to advance")
    made = makes(standing.plan, state)
    if made is not None and made.kind is None:  # the serving commitment; replicas may still start
        return Commit(made.commitment, [])
    busy = standing.busy()
    if busy:
        names = ", ".join(f"{label(j.kind, j.arm, j.role)} ({j.state})" for j in busy)
        return Wait("phase-running", f"the {state} phase is still running: {names}")
    missing = standing.next_stage()
    if not missing:
        return Wait("phase-complete", f"every job of the {state} phase succeeded; nothing is left to queue")
    if not retry and any(order.matches(job) for order in missing for job in standing.jobs):
        return Wait("job-ended", f"a job of the {state} phase ended without success; the operator decides")
    return Queue(missing)
