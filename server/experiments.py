"""The experiment service: creating experiments from a plan and recording what finished jobs commit.

Guards and transitions are lifecycle.py's; which jobs each phase queues is phases.py's.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.canonical import canonical_bytes, identity, sha256_bytes
from experiment.errors import CoopError
from experiment.plan import Plan, parse_plan, plan_identity, seed_identity
from server import blobs, commitments, evidence, models
from server.errors import NotFound
from server.lifecycle import (
    EVALUATED_ARMS,
    SERVED_ARM,
    TRAINED_ARMS,
    ExperimentState,
    JobState,
    Refused,
    TrainedArm,
    experiment_target,
    guard_job,
    guard_selection,
    guard_serving,
    move_experiment,
)
from server.settings import Settings

E = ExperimentState
T = TypeVar("T")
# experiment.selection.Candidate's fields, every one present (null where unknown): the committed document is
# then exactly what experiment.selection writes and reads, so both compute the same selection identity.
CANDIDATE_FIELDS = wire.SelectResult.__struct_fields__


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def plan_of(experiment: models.Experiment) -> Plan:
    return msgspec.convert(experiment.plan, type=Plan)


async def load(session: AsyncSession, experiment_id: uuid.UUID, *, lock: bool = False) -> models.Experiment:
    """The experiment row; ``lock`` serialises concurrent advances of one experiment (FOR UPDATE on Postgres)."""
    statement = select(models.Experiment).where(models.Experiment.id == experiment_id)
    if lock:
        statement = statement.with_for_update()
    experiment = await session.scalar(statement)
    if experiment is None:
        raise NotFound(f"experiment {experiment_id} does not exist")
    return experiment


async def arms_of(session: AsyncSession, experiment_id: uuid.UUID) -> dict[str, models.Arm]:
    rows = await session.scalars(select(models.Arm).where(models.Arm.experiment_id == experiment_id))
    return {arm.name: arm for arm in rows}


async def create(session: AsyncSession, settings: Settings, body: wire.ExperimentCreate) -> models.Experiment:
    plan = parse_plan(body.plan_toml.encode(), "in the request body")
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
    world_sizes = {"seed": 1, "clean-single": 1, "damaged-single": 1, "clean-pair": plan.training.pair_world_size}
    for name, world_size in world_sizes.items():
        session.add(
            models.Arm(
                experiment_id=experiment.id,
                name=name,
                world_size=world_size,
                serving_eligible=name == SERVED_ARM,
            )
        )
    if body.commit:
        await commit_plan(session, settings, experiment)
    return experiment


async def commit_plan(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> None:
    move_experiment(session, experiment, E.COMMITTED, "plan committed")
    await commitments.append(
        session, experiment.id, "plan", experiment.plan_identity, {"name": experiment.name, "plan": experiment.plan}
    )
    await enqueue(session, settings, experiment, wire.JobCreate(kind="prepare"))


async def enqueue(
    session: AsyncSession,
    settings: Settings,
    experiment: models.Experiment,
    body: wire.JobCreate,
    *,
    pinned: uuid.UUID | None = None,
) -> models.Job:
    """Queue a job the protocol allows now; ``pinned`` names the only agent that may claim it."""
    ledger = await commitments.committed(session, experiment.id)
    guard_job(experiment.state, ledger, body.kind, body.arm, body.role)
    world_size = 1
    if pinned is None and body.arm is not None and body.arm != "seed":
        arm = (await arms_of(session, experiment.id))[body.arm]
        if body.kind == "train":
            world_size = arm.world_size
        else:
            # Evaluations and selection of a trained arm need its checkpoint: they run on the host holding it.
            pinned = arm.holder_agent_id
    job = models.Job(
        experiment_id=experiment.id,
        kind=body.kind,
        arm=body.arm,
        role=body.role,
        spec=body.spec,
        world_size=world_size,
        state=JobState.QUEUED,
        attempts_made=0,
        max_attempts=settings.max_attempts,
        ranks_open=world_size,
        pinned_agent_id=pinned,
        queued_at=_now(),
    )
    session.add(job)
    await session.flush()
    if body.kind == "train" and experiment.state == E.PREPARED:
        move_experiment(session, experiment, E.TRAINING, "training queued")
    return job


async def generation(session: AsyncSession, job: models.Job) -> list[models.Attempt]:
    """The attempts of the job's current generation, by rank."""
    rows = await session.scalars(
        select(models.Attempt)
        .where(models.Attempt.job_id == job.id, models.Attempt.number == job.attempts_made)
        .order_by(models.Attempt.rank)
    )
    return list(rows)


async def results_of(session: AsyncSession, job: models.Job) -> list[dict[str, Any]]:
    """The results of the job's current attempt generation, by rank."""
    return [row.result or {} for row in await generation(session, job)]


def _convert(data: dict[str, Any], kind: type[T], job: models.Job) -> T:
    try:
        return msgspec.convert(data, type=kind)
    except msgspec.ValidationError as exc:
        raise CoopError(f"the result of {job.kind} job {job.id} is malformed: {exc}") from exc


async def job_succeeded(session: AsyncSession, settings: Settings, job: models.Job) -> None:
    """Advance the experiment after every rank of ``job`` succeeded."""
    experiment = await load(session, job.experiment_id, lock=True)
    results = await results_of(session, job)
    if job.kind == "prepare":
        prepared = _convert(results[0], wire.PrepareResult, job)
        experiment_target(experiment.state, E.PREPARED)
        experiment.prepared_identity = prepared.prepared_identity
        await commitments.append(
            session, experiment.id, "prepared", prepared.prepared_identity, {"plan_identity": experiment.plan_identity}
        )
        move_experiment(session, experiment, E.PREPARED, f"prepare job {job.id} succeeded")
    elif job.kind == "train":
        await _record_training(session, experiment, job, results)
    elif job.kind == "select":
        await _record_verified_checkpoint(session, settings, experiment)
    elif job.kind == "evaluate" and job.role == "test":
        await _record_test_evaluation(session, experiment)


async def _record_training(
    session: AsyncSession, experiment: models.Experiment, job: models.Job, results: list[dict[str, Any]]
) -> None:
    trained = [_convert(result, wire.TrainResult, job) for result in results]
    if len({(t.step, t.model_identity) for t in trained}) != 1:
        raise Refused("ranks-must-agree", f"the ranks of train job {job.id} report different final checkpoints")
    final = trained[0]
    if not final.final or final.step != plan_of(experiment).training.updates:
        raise Refused("train-result-final-checkpoint", f"train job {job.id} did not report the final checkpoint")
    arms = await arms_of(session, experiment.id)
    arm = arms[job.arm or ""]
    arm.final_step, arm.model_identity, arm.receipt_sha256 = final.step, final.model_identity, final.receipt_sha256
    arm.binding, arm.checkpoint_path = final.binding, final.checkpoint_path
    # Every rank's host holds an identical copy of the final checkpoint. The arm's evaluations and selection
    # run on the rank host holding the fewest other arms, so that the hosts share the evaluation work.
    ranks = await generation(session, job)
    held = [other.holder_agent_id for other in arms.values() if other is not arm]
    hosts = [attempt.agent_id for attempt in ranks]
    arm.holder_agent_id = min(hosts, key=lambda host: (held.count(host), hosts.index(host)), default=None)
    if experiment.state == E.TRAINING and all(arms[name].model_identity for name in TRAINED_ARMS):
        move_experiment(session, experiment, E.TRAINED, "every arm has a verified final checkpoint")


async def _record_test_evaluation(session: AsyncSession, experiment: models.Experiment) -> None:
    done = await session.scalars(
        select(models.Job).where(
            models.Job.experiment_id == experiment.id,
            models.Job.kind == "evaluate",
            models.Job.role == "test",
            models.Job.state == JobState.SUCCEEDED,
        )
    )
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for job in done:
        by_arm[job.arm or ""] = await results_of(session, job)
    if experiment.state != E.SELECTED or any(arm not in by_arm for arm in EVALUATED_ARMS):
        return
    body = {"arms": {arm: by_arm[arm] for arm in EVALUATED_ARMS}}
    await commitments.append(session, experiment.id, "tested", identity(body), body)
    move_experiment(session, experiment, E.TESTED, "every arm was evaluated on the test role")


async def _latest_succeeded(session: AsyncSession, experiment_id: uuid.UUID, kind: str) -> dict[str, models.Job]:
    """Per arm, the last job of ``kind`` that succeeded."""
    rows = await session.scalars(
        select(models.Job)
        .where(
            models.Job.experiment_id == experiment_id, models.Job.kind == kind, models.Job.state == JobState.SUCCEEDED
        )
        .order_by(models.Job.queued_at)
    )
    return {job.arm or "": job for job in rows}


async def _record_verified_checkpoint(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> None:
    """Once every trained arm's host verified its final checkpoint (select jobs), commit the selection."""
    verified = await _latest_succeeded(session, experiment.id, "select")
    if experiment.state != E.TRAINED or any(arm not in verified for arm in TRAINED_ARMS):
        return
    candidates: dict[str, dict[str, Any]] = {}
    for arm in TRAINED_ARMS:
        job = verified[arm]
        result = _convert((await results_of(session, job))[0], wire.SelectResult, job)
        if result.arm != arm:
            raise Refused("select-result-arm", f"select job {job.id} verified {result.arm}, not {arm}")
        candidates[arm] = msgspec.to_builtins(result)
    await commit_selection(session, settings, experiment, candidates)


async def select_checkpoints(
    session: AsyncSession, settings: Settings, experiment: models.Experiment, body: wire.SelectionCreate
) -> None:
    """The operator's selection by REST: the named final checkpoints, as the coordinator recorded them."""
    arms = await arms_of(session, experiment.id)
    candidates = {
        name: {
            "arm": name,
            "model_identity": pick.model_identity,
            "step": pick.step,
            "path": arms[name].checkpoint_path if name in arms else None,
            "binding": arms[name].binding if name in arms else None,
            "receipt_sha256": arms[name].receipt_sha256 if name in arms else None,
        }
        for name, pick in body.arms.items()
    }
    await commit_selection(session, settings, experiment, candidates)


async def commit_selection(
    session: AsyncSession, settings: Settings, experiment: models.Experiment, candidates: dict[str, dict[str, Any]]
) -> None:
    """Commit the selection document (experiment.selection.Selection, the seed included) and keep it as the
    bundle's selection.json: its identity is the one test evaluations and the report check."""
    experiment_target(experiment.state, E.SELECTED)
    arms = await arms_of(session, experiment.id)
    recorded = {name: TrainedArm(name, arm.final_step, arm.model_identity) for name, arm in arms.items()}
    chosen = {name: (int(pick["step"]), str(pick["model_identity"])) for name, pick in candidates.items()}
    guard_selection(recorded, chosen, plan_of(experiment).training.updates)
    document = {
        "plan_identity": experiment.plan_identity,
        "prepared_identity": experiment.prepared_identity,
        "arms": {
            name: {field: pick.get(field) for field in CANDIDATE_FIELDS}
            for name, pick in (
                {"seed": {"arm": "seed", "model_identity": seed_identity(plan_of(experiment))}} | candidates
            ).items()
        },
    }
    selection_identity = identity(document)
    data = canonical_bytes(document) + b"\n"

    async def chunks() -> AsyncIterator[bytes]:
        yield data

    await blobs.store(session, settings, sha256_bytes(data), chunks(), "application/json", len(data))
    await evidence.attach(session, experiment.id, {"selection.json": sha256_bytes(data)})
    await commitments.append(session, experiment.id, "selection", selection_identity, document)
    experiment.selection_identity = selection_identity
    move_experiment(session, experiment, E.SELECTED, "final checkpoints selected")


async def start_serving(session: AsyncSession, experiment: models.Experiment, body: wire.ServingCreate) -> None:
    entries = await commitments.entries(session, experiment.id)
    selection = next((entry.body for entry in entries if entry.kind == "selection"), {})
    guard_serving(body.arm, body.model_identity, selection.get("arms", {}))
    experiment_target(experiment.state, E.SERVING)
    document = {
        "arm": body.arm,
        "model_identity": body.model_identity,
        "selection_identity": experiment.selection_identity,
    }
    await commitments.append(session, experiment.id, "serving", identity(document), document)
    move_experiment(session, experiment, E.SERVING, f"serving {body.arm}")


async def record_report(
    session: AsyncSession, settings: Settings, experiment: models.Experiment, report: dict[str, Any]
) -> str:
    """Commit the report the coordinator computed (server.reporter), kept as a blob of its canonical bytes so that
    the blob's name is the report identity; returns that identity. Nothing else records a report."""
    experiment_target(experiment.state, E.REPORTED)
    data = canonical_bytes(report)
    report_identity = sha256_bytes(data)

    async def chunks() -> AsyncIterator[bytes]:
        yield data

    await blobs.store(session, settings, report_identity, chunks(), "application/json", len(data))
    await commitments.append(session, experiment.id, "report", report_identity, {"blob": report_identity})
    move_experiment(session, experiment, E.REPORTED, "report recorded")
    return report_identity


async def report_file(session: AsyncSession, settings: Settings, experiment_id: uuid.UUID) -> Path:
    """The recorded report JSON; NotFound until the report commitment exists."""
    entry = next((e for e in await commitments.entries(session, experiment_id) if e.kind == "report"), None)
    if entry is None:
        raise NotFound(f"experiment {experiment_id} has no recorded report yet")
    _, path = await blobs.find(session, settings, entry.identity)
    return path


def halt(session: AsyncSession, experiment: models.Experiment, reason: str) -> None:
    move_experiment(session, experiment, E.HALTED, reason)
