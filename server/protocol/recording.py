"""What an experiment records: its creation from a plan, what a finished job's result records, and the
commitments of the ledger. It never moves the experiment: phases.progress does, from what is recorded here.
Every commitment is appended by ``commit``, which checks that the state it lets the experiment enter may come next.

Guards and transitions are lifecycle.py's; which jobs each phase queues, and when a phase is complete, is
table.py's; which record a job's success calls is its kind's (kinds.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core import layout
from experiment.core.canonical import JsonObject, canonical_bytes, sha256_bytes
from experiment.core.errors import CoopError
from experiment.core.plan import Plan, parse_plan, plan_identity, require_staged, seed_identity
from experiment.core.states import ExperimentState
from server import models
from server.dispatch import queue
from server.dispatch.lifecycle import Refused, experiment_target
from server.httperrors import NotFound
from server.protocol import table
from server.protocol.guards import TrainedArm, guard_selection, guard_serving
from server.settings import Settings
from server.store import blobstore, commitments, evidencefiles, views

E = ExperimentState
R = TypeVar("R", bound=wire.Tagged)


@dataclass(frozen=True)
class Document:
    """A commitment to append: its kind and body, its identity where that is not the body's own (the plan's, the
    prepared inputs', the report blob's), and the bundle file that keeps the body's canonical bytes, if any."""

    kind: str
    body: JsonObject
    identity: str | None = None
    file: str | None = None


async def load(session: AsyncSession, experiment_id: uuid.UUID, *, lock: bool = False) -> models.Experiment:
    """The experiment row; ``lock`` serialises concurrent advances of one experiment (FOR UPDATE on Postgres)."""
    statement = select(models.Experiment).where(models.Experiment.id == experiment_id)
    if lock:  # the row as the lock found it, even where this session had read it before
        statement = statement.with_for_update().execution_options(populate_existing=True)
    experiment = await session.scalar(statement)
    if experiment is None:
        raise NotFound(f"experiment {experiment_id} does not exist")
    return experiment


async def arms_of(session: AsyncSession, experiment_id: uuid.UUID) -> dict[str, models.Arm]:
    rows = await session.scalars(select(models.Arm).where(models.Arm.experiment_id == experiment_id))
    return {arm.name: arm for arm in rows}


async def create(session: AsyncSession, body: wire.ExperimentCreate) -> models.Experiment:
    """The experiment and its arms, in draft (phases.create commits it)."""
    plan = parse_plan(body.plan_toml.encode(), "in the request body")
    require_staged(plan)  # what prepare checks the seed and the reference home against is fixed before the commit
    experiment = models.Experiment(
        name=plan.name,
        state=E.DRAFT,
        plan_toml=body.plan_toml,
        plan=msgspec.to_builtins(plan),
        plan_identity=plan_identity(plan),
        autopilot=body.autopilot,
    )
    session.add(experiment)
    await session.flush()
    for name in plan.arm_names():
        session.add(
            models.Arm(
                experiment_id=experiment.id,
                name=name,
                world_size=plan.world_size(name),
                serving_eligible=plan.serves() and name == plan.served_arm(),
            )
        )
    return experiment


async def commit(session: AsyncSession, settings: Settings, experiment: models.Experiment, document: Document) -> None:
    """Append a commitment to the experiment's ledger, with the bundle file it keeps; refused unless the state the
    commitment lets the experiment enter may come next."""
    experiment_target(experiment.state, table.ENTERS[document.kind])
    body = canonical_bytes(document.body)
    committed = sha256_bytes(body) if document.identity is None else document.identity
    if document.file is not None:
        await evidencefiles.keep(session, settings, experiment.id, document.file, body + b"\n")
    await commitments.append(session, experiment.id, document.kind, committed, document.body)
    if document.kind == "prepared":
        experiment.prepared_identity = committed
    if document.kind == "selection":
        experiment.selection_identity = committed


async def commit_plan(
    session: AsyncSession, settings: Settings, experiment: models.Experiment, canary: JsonObject | None
) -> None:
    """Commit the plan (phases.commit queues the prepare job with it), with what its canary found, or the
    operator's override (protocol.canaries)."""
    body: JsonObject = {"name": experiment.name, "plan": experiment.plan}
    if canary is not None:
        body["canary"] = canary
    await commit(session, settings, experiment, Document("plan", body, experiment.plan_identity))


async def results_of(session: AsyncSession, job: models.Job) -> list[JsonObject]:
    """The results of the job's current attempt generation, by rank, as the wire carries them (untagged)."""
    return [row.result or {} for row in await queue.generation(session, job)]


def decoded(results: list[JsonObject], kind: type[R], job: models.Job) -> list[R]:
    """Stored results as their kind's type (each was checked when its attempt reported it)."""
    try:
        return [wire.decode(result, kind) for result in results]
    except msgspec.ValidationError as exc:
        raise CoopError(f"the result of {job.kind} job {job.id} is malformed: {exc}") from exc


async def record_prepared(
    session: AsyncSession,
    settings: Settings,
    experiment: models.Experiment,
    job: models.Job,
    done: list[wire.PrepareResult],
) -> None:
    """Commit the prepared identity the prepare job computed."""
    body: JsonObject = {"plan_identity": experiment.plan_identity}
    await commit(session, settings, experiment, Document("prepared", body, done[0].prepared_identity))


async def record_training(
    session: AsyncSession,
    settings: Settings,
    experiment: models.Experiment,
    job: models.Job,
    trained: list[wire.TrainResult],
) -> None:
    """Record the arm's final checkpoint, which every rank of its train job reported alike, and the host that
    holds it for the arm's evaluations and selection."""
    if len({(t.step, t.model_identity) for t in trained}) != 1:
        raise Refused("ranks-must-agree", f"the ranks of train job {job.id} report different final checkpoints")
    final = trained[0]
    if not final.final or final.step != views.plan_of(experiment).training.updates:
        raise Refused("train-result-final-checkpoint", f"train job {job.id} did not report the final checkpoint")
    arms = await arms_of(session, experiment.id)
    arm = arms[job.arm or ""]
    arm.final_step, arm.model_identity, arm.receipt_sha256 = final.step, final.model_identity, final.receipt_sha256
    arm.binding, arm.checkpoint_path = final.binding, final.checkpoint_path
    # Every rank's host holds an identical copy of the final checkpoint. The arm's evaluations and selection
    # run on the rank host holding the fewest other arms, so that the hosts share the evaluation work.
    ranks = await queue.generation(session, job)
    held = [other.holder_agent_id for other in arms.values() if other is not arm]
    hosts = [attempt.agent_id for attempt in ranks if attempt.agent_id is not None]
    arm.holder_agent_id = min(hosts, key=lambda host: (held.count(host), hosts.index(host)), default=None)


async def tested(
    session: AsyncSession, experiment: models.Experiment, plan: Plan, evaluations: list[models.Job]
) -> Document:
    """The commitment of the test evaluations of every arm (phases.progress names them: its stage's, all
    succeeded)."""
    by_arm: JsonObject = {job.arm or "": list(await results_of(session, job)) for job in evaluations}
    body: JsonObject = {"arms": {arm: by_arm[arm] for arm in plan.arm_names()}}
    return Document("tested", body)


async def verified_selection(
    session: AsyncSession, experiment: models.Experiment, plan: Plan, selections: list[models.Job]
) -> Document:
    """The selection of the final checkpoints every trained arm's host verified (phases.progress names the select
    jobs: its stage's, all succeeded)."""
    candidates: dict[str, wire.Candidate] = {}
    for job in selections:
        arm = job.arm or ""
        (result,) = decoded((await results_of(session, job))[:1], wire.SelectResult, job)
        if result.candidate.arm != arm:
            raise Refused("select-result-arm", f"select job {job.id} verified {result.candidate.arm}, not {arm}")
        candidates[arm] = result.candidate
    return await selection(session, experiment, plan, candidates)


async def select_checkpoints(
    session: AsyncSession, settings: Settings, experiment: models.Experiment, body: wire.SelectionCreate
) -> None:
    """The operator's selection by REST: the named final checkpoints, as the coordinator recorded them."""
    experiment_target(experiment.state, E.SELECTED)  # before the picks are checked against the arms
    arms = await arms_of(session, experiment.id)
    candidates = {
        name: wire.Candidate(
            arm=name,
            model_identity=pick.model_identity,
            step=pick.step,
            path=arms[name].checkpoint_path if name in arms else None,
            binding=arms[name].binding if name in arms else None,
            receipt_sha256=arms[name].receipt_sha256 if name in arms else None,
        )
        for name, pick in body.arms.items()
    }
    await commit(
        session, settings, experiment, await selection(session, experiment, views.plan_of(experiment), candidates)
    )


async def selection(
    session: AsyncSession, experiment: models.Experiment, plan: Plan, candidates: dict[str, wire.Candidate]
) -> Document:
    """The selection document (experiment.learning.selection.Selection, the seed included), kept as the bundle's
    selection.json: its identity is the one test evaluations and the report check."""
    arms = await arms_of(session, experiment.id)
    recorded = {name: TrainedArm(name, arm.final_step, arm.model_identity) for name, arm in arms.items()}
    chosen = {name: (pick.step, pick.model_identity) for name, pick in candidates.items()}
    guard_selection(plan, recorded, chosen, plan.training.updates)
    baseline = plan.arm("baseline")
    seed = wire.Candidate(arm=baseline, model_identity=seed_identity(plan))
    # Every field of each candidate, null where unknown: the document is exactly what experiment.learning.selection
    # writes and reads, so both compute the same selection identity.
    document: JsonObject = {
        "plan_identity": experiment.plan_identity,
        "prepared_identity": experiment.prepared_identity,
        "arms": {name: msgspec.to_builtins(pick) for name, pick in ({baseline: seed} | candidates).items()},
    }
    return Document("selection", document, file=layout.SELECTION)


async def final_serving(
    session: AsyncSession, experiment: models.Experiment, plan: Plan, jobs: list[models.Job]
) -> Document:
    """The serving commitment of the served arm's final checkpoint, which its selection names (made with no job,
    when the tested experiment is advanced)."""
    name = plan.served_arm()
    served = (await arms_of(session, experiment.id))[name]
    body = wire.ServingCreate(arm=name, model_identity=served.model_identity or "")
    return await serving(session, experiment, plan, body)


async def serving(
    session: AsyncSession, experiment: models.Experiment, plan: Plan, body: wire.ServingCreate
) -> Document:
    """The serving commitment the operator asked for: the served arm's selected checkpoint."""
    selected = (await commitments.by_kind(session, experiment.id)).get("selection")
    chosen = {} if selected is None else selected.body
    guard_serving(plan, body.arm, body.model_identity, chosen.get("arms", {}))
    document: JsonObject = {
        "arm": body.arm,
        "model_identity": body.model_identity,
        "selection_identity": experiment.selection_identity,
    }
    return Document("serving", document)


async def store_report(session: AsyncSession, settings: Settings, report: JsonObject) -> str:
    """Keep the report the coordinator computed (server.reporter) as a blob of its canonical bytes, so that the
    blob's name is the report identity; returns that identity."""
    return await blobstore.store_bytes(session, settings, canonical_bytes(report))


async def commit_report(
    session: AsyncSession, settings: Settings, experiment: models.Experiment, report_identity: str
) -> None:
    """Commit a stored report."""
    await commit(session, settings, experiment, Document("report", {"blob": report_identity}, report_identity))


async def record_report(
    session: AsyncSession,
    settings: Settings,
    experiment: models.Experiment,
    job: models.Job,
    done: list[wire.ReportResult],
) -> None:
    """Commit the report the coordinator's report job stored (server.reporter)."""
    await commit_report(session, settings, experiment, done[0].report_identity)


async def store_and_commit_report(
    session: AsyncSession, settings: Settings, experiment: models.Experiment, report: JsonObject
) -> str:
    """Store and commit a report at once; returns its identity. Nothing but the coordinator's report job records
    a report (tests use this to stand for one)."""
    experiment_target(experiment.state, E.REPORTED)
    report_identity = await store_report(session, settings, report)
    await commit_report(session, settings, experiment, report_identity)
    return report_identity


async def report_file(session: AsyncSession, settings: Settings, experiment_id: uuid.UUID) -> Path:
    """The recorded report JSON; NotFound until the report commitment exists."""
    entry = (await commitments.by_kind(session, experiment_id)).get("report")
    if entry is None:
        raise NotFound(f"experiment {experiment_id} has no recorded report yet")
    _, path = await blobstore.find(session, settings, entry.identity)
    return path


Maker = Callable[[AsyncSession, models.Experiment, Plan, list[models.Job]], Awaitable[Document]]
# How each commitment that a state makes (table.Makes) is made: from the jobs named, or from the ledger alone.
MAKERS: dict[str, Maker] = {"selection": verified_selection, "tested": tested, "serving": final_serving}
