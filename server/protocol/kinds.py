"""The job kinds, one entry each: what a kind's job is given and returns (its wire spec and result types), what
the protocol asks before it is queued (its guard), where it runs, what part of the evidence bundle it
writes, what its result may carry and what its success records. Everything that differs between kinds is read
from here; a new kind is an entry in this table, its wire types (experiment/wire.py) and the agent's handler
(agent/jobs.py)."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core import layout
from experiment.core.canonical import JsonObject
from experiment.core.plan import Plan
from experiment.core.states import JobState
from server import models
from server.access import secret
from server.dispatch import waiters
from server.dispatch.lifecycle import Refused
from server.httperrors import BadRequest
from server.protocol import guards, recording, replicas
from server.protocol.table import Order
from server.settings import Settings
from server.store import listings, views
from server.store.commitments import Ledger

S = TypeVar("S", bound=wire.Tagged)  # a kind's spec
R = TypeVar("R", bound=wire.Tagged)  # a kind's result


@dataclass(frozen=True)
class Placement(Generic[S]):
    """Where a job runs: its spec as queued (the coordinator may fill it in), its ranks and the only agent that may
    claim it (the host holding the files it needs)."""

    spec: S
    world_size: int = 1
    pinned: uuid.UUID | None = None


Place = Callable[[AsyncSession, models.Experiment, "str | None", S], Awaitable[Placement[S]]]
Writes = Callable[[models.Job, models.Attempt], tuple[str, ...]]
Answers = Callable[[AsyncSession, Settings, models.Job, models.Attempt, wire.AttemptResult, R], Awaitable[None]]
Settle = Callable[[AsyncSession, Settings, models.Experiment, models.Job, list[R]], Awaitable[None]]
Printed = Callable[[AsyncSession, models.Job, S, set[str]], Awaitable["wire.JobSpec | None"]]


async def _anywhere(session: AsyncSession, experiment: models.Experiment, arm: str | None, spec: S) -> Placement[S]:
    return Placement(spec)


async def _as_gang(session: AsyncSession, experiment: models.Experiment, arm: str | None, spec: S) -> Placement[S]:
    """A train job has one rank per member of its arm's gang."""
    return Placement(spec, world_size=views.plan_of(experiment).world_size(str(arm)))


async def _canary_gang(
    session: AsyncSession, experiment: models.Experiment, arm: str | None, spec: wire.CanarySpec
) -> Placement[wire.CanarySpec]:
    """A canary has one rank per host of the plan's largest gang, and carries the draft's plan (no ledger holds it
    yet)."""
    plan = views.plan_of(experiment)
    filled = wire.CanarySpec(plan_toml=experiment.plan_toml)
    return Placement(filled, world_size=plan.world_size(plan.largest_gang()))


async def _on_holder(session: AsyncSession, experiment: models.Experiment, arm: str | None, spec: S) -> Placement[S]:
    """Evaluations and selection of a trained arm need its checkpoint: they run on the host holding it."""
    if arm is None or not views.plan_of(experiment).arm_plan(arm).trained:
        return Placement(spec)
    return Placement(spec, pinned=(await recording.arms_of(session, experiment.id))[arm].holder_agent_id)


def _on_pair_host(
    place: Callable[[AsyncSession, models.Experiment, S], Awaitable[tuple[uuid.UUID, S]]],
) -> Place[S]:
    """A serving job runs on the pair host replicas.py names for it."""

    async def placed(session: AsyncSession, experiment: models.Experiment, arm: str | None, spec: S) -> Placement[S]:
        host, filled = await place(session, experiment, spec)
        return Placement(filled, pinned=host)

    return placed


def _writes_nothing(job: models.Job, attempt: models.Attempt) -> tuple[str, ...]:
    return ()


def _writes_prepared(job: models.Job, attempt: models.Attempt) -> tuple[str, ...]:
    return (f"{layout.PREPARED}/", f"{layout.SEED}/")


def _writes_run(job: models.Job, attempt: models.Attempt) -> tuple[str, ...]:
    return (f"{layout.run(str(job.arm), attempt.rank)}/",)


def _writes_evaluation(job: models.Job, attempt: models.Attempt) -> tuple[str, ...]:
    return (f"{layout.evaluation(str(job.role), str(job.arm))}/",)


def _writes_serving(job: models.Job, attempt: models.Attempt) -> tuple[str, ...]:
    return (f"{layout.SERVING}/",)


async def _answers(
    session: AsyncSession,
    settings: Settings,
    job: models.Job,
    attempt: models.Attempt,
    body: wire.AttemptResult,
    result: wire.EvaluateResult,
) -> None:
    await listings.record_answers(session, settings, job, attempt, body, result.answers_sha256)


@dataclass(frozen=True)
class Kind(Generic[S, R]):
    name: wire.JobKind
    spec: type[S]
    result: type[R]
    # The protocol's rule for queueing one (guards.py); every kind also meets guards.guard_job.
    guard: Callable[[guards.Proposal], None] = guards.unguarded
    needs_arm: bool = False
    place: Place[S] = _anywhere
    writes: Writes = _writes_nothing  # the bundle folders one writes (docs/evidence.md)
    answers: Answers[R] | None = None  # a result with evaluated answers: how they are checked and kept
    serving: bool = False  # its result carries serving phases
    settle: Settle[R] | None = None  # what its success records
    printed: Printed[S] | None = None  # what its command's events ask of the coordinator
    by_agents: bool = True  # False: the coordinator runs it itself (server.reporter)
    serving_token: bool = False  # its claim carries the probes' token
    spec_rule: str | None = None  # the rule a malformed spec breaks (409); None: 400 naming the field


def _replica(
    name: wire.JobKind,
    spec: type[S],
    result: type[R],
    place: Callable[[AsyncSession, models.Experiment, S], Awaitable[tuple[uuid.UUID, S]]],
) -> Kind[S, R]:
    """A replica's start or stop: on the host of its rank of the pair, its claim carrying the probes' token."""
    return Kind(
        name,
        spec,
        result,
        guards.guard_replica_job,
        needs_arm=True,
        place=_on_pair_host(place),
        serving_token=True,
        spec_rule="serving-spec",
    )


TABLE: dict[str, Kind[Any, Any]] = {
    entry.name: entry
    for entry in (
        Kind("canary", wire.CanarySpec, wire.CanaryResult, guards.guard_canary, place=_canary_gang),
        # Prepare is queued when the plan is committed, and again after one failed: no rule of its own.
        Kind(
            "prepare", wire.PrepareSpec, wire.PrepareResult, writes=_writes_prepared, settle=recording.record_prepared
        ),
        Kind(
            "train",
            wire.TrainSpec,
            wire.TrainResult,
            guards.guard_train,
            needs_arm=True,
            place=_as_gang,
            writes=_writes_run,
            settle=recording.record_training,
        ),
        Kind(
            "evaluate",
            wire.EvaluateSpec,
            wire.EvaluateResult,
            guards.guard_evaluate,
            needs_arm=True,
            place=_on_holder,
            writes=_writes_evaluation,
            answers=_answers,
        ),
        Kind("select", wire.SelectSpec, wire.SelectResult, guards.guard_select, place=_on_holder),
        _replica("replica-start", wire.ReplicaStartSpec, wire.ReplicaStartResult, replicas.place_replica_start),
        _replica("replica-stop", wire.ReplicaStopSpec, wire.ReplicaStopResult, replicas.place_replica_stop),
        Kind(
            "benchmark",
            wire.BenchmarkSpec,
            wire.BenchmarkResult,
            guards.guard_benchmark,
            place=_on_pair_host(replicas.place_benchmark),
            writes=_writes_serving,
            serving=True,
            printed=replicas.stop_due,
            serving_token=True,
            spec_rule="serving-spec",
        ),
        Kind(
            "report",
            wire.ReportSpec,
            wire.ReportResult,
            guards.guard_report,
            settle=recording.record_report,
            by_agents=False,
        ),
    )
}
BY_AGENTS: tuple[str, ...] = tuple(name for name, entry in TABLE.items() if entry.by_agents)
BY_COORDINATOR: tuple[str, ...] = tuple(name for name, entry in TABLE.items() if not entry.by_agents)


def of(name: str) -> Kind[Any, Any]:
    return TABLE[name]


def _at(exc: msgspec.ValidationError, field: str) -> str:
    """msgspec's message with its path under ``field`` of the request body."""
    return str(exc).replace("`$", f"`{field}", 1)


def order_of(body: wire.JobCreate) -> Order:
    """The operator's job, its spec read strictly as its kind's (a malformed one breaks the kind's rule)."""
    kind = of(body.kind)
    try:
        spec = wire.decode(body.spec, kind.spec)
    except msgspec.ValidationError as exc:
        detail = f"the spec of a {body.kind} job is malformed: {_at(exc, '$.spec')}"
        if kind.spec_rule is None:
            raise BadRequest(detail) from None
        raise Refused(kind.spec_rule, detail) from None
    return Order(spec, body.arm, body.role)


async def enqueue(
    session: AsyncSession,
    settings: Settings,
    experiment: models.Experiment,
    order: Order,
    plan: Plan,
    ledger: Ledger,
) -> models.Job:
    """Queue a job the protocol allows now (the experiment's plan and ledger say), where it must run."""
    kind = of(order.kind)
    proposal = guards.Proposal(order.kind, experiment.state, ledger, plan, order.arm, order.role)
    guards.guard_job(proposal, needs_arm=kind.needs_arm)
    kind.guard(proposal)
    placed = await kind.place(session, experiment, order.arm, order.spec)
    job = models.Job(
        experiment_id=experiment.id,
        kind=order.kind,
        arm=order.arm,
        role=order.role,
        spec=wire.untagged(placed.spec),
        world_size=placed.world_size,
        state=JobState.QUEUED,
        attempts_made=0,
        max_attempts=settings.max_attempts,
        ranks_open=placed.world_size,
        pinned_agent_id=placed.pinned,
        queued_at=datetime.datetime.now(datetime.UTC),
    )
    session.add(job)
    await session.flush()
    waiters.claimable(session)
    return job


def hand_out(settings: Settings, assignment: wire.Assignment) -> wire.Assignment:
    """A claim as its agent gets it: a serving job's spec carries the probes' token, which is stored nowhere."""
    if not of(assignment.kind).serving_token:
        return assignment
    token = secret.serving_token(settings.home, assignment.experiment_id)
    return msgspec.structs.replace(assignment, spec=assignment.spec | {"serving_token": token})


async def record_result(
    session: AsyncSession, settings: Settings, job: models.Job, attempt: models.Attempt, body: wire.AttemptResult
) -> JsonObject:
    """Check an attempt's result against its job's kind and keep what it measured and produced; returns the result
    as the attempt row keeps it (untagged, empty unless it succeeded)."""
    kind = of(job.kind)
    result = None
    if body.outcome == "succeeded":
        try:
            result = wire.decode(body.result, kind.result)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"the result of a {job.kind} job is malformed: {_at(exc, '$.result')}") from None
    elif body.result:
        raise BadRequest("a result accompanies a succeeded outcome only")
    await listings.record(session, job, attempt, body)
    if body.answers and kind.answers is None:
        doers = ", ".join(name for name, other in TABLE.items() if other.answers is not None)
        raise BadRequest(f"a {job.kind} job reports no answers; only {doers} jobs do")
    if body.serving and not kind.serving:
        doers = ", ".join(name for name, other in TABLE.items() if other.serving)
        raise BadRequest(f"a {job.kind} job reports no serving phases; only {doers} jobs do")
    if result is not None and kind.answers is not None:
        await kind.answers(session, settings, job, attempt, body, result)
    if body.serving:
        listings.record_serving(session, job, attempt, body.serving)
    return {} if result is None else wire.untagged(result)


async def settle(session: AsyncSession, settings: Settings, experiment: models.Experiment, job: models.Job) -> None:
    """Record what the job's success commits (every rank of it succeeded); the caller holds the experiment's lock."""
    kind = of(job.kind)
    if kind.settle is None:
        return
    done = recording.decoded(await recording.results_of(session, job), kind.result, job)
    await kind.settle(session, settings, experiment, job, done)


async def printed(session: AsyncSession, job: models.Job, names: set[str]) -> Order | None:
    """The job the coordinator queues because a job's command printed ``names`` (events), if any."""
    kind = of(job.kind)
    if kind.printed is None:
        return None
    spec = await kind.printed(session, job, wire.decode(job.spec, kind.spec), names)
    return None if spec is None else Order(spec, job.arm)
