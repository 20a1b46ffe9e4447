"""The serving phase's jobs: which host each runs on, what each is given, and the mid-phase stop.

Both hosts of the pair start a replica of the selected clean-pair final checkpoint (each from its own rank's
copy) behind its probe; rank 0's host then benchmarks the single phase (its own probe), the pair phase
(both) and the failure phase (both), in which the coordinator stops rank 1's replica as soon as the benchmark
reports the set number of completions (its ``stop-replica`` event); finally both replicas are stopped.
The probes' bearer token is derived from the coordinator's secret per experiment and handed only to the
agents that claim a serving job; it is stored nowhere.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import experiments, models
from server.lifecycle import JOB_ACTIVE, SERVED_ARM, JobState, Refused
from server.settings import Settings
from server.web import keys

KINDS = frozenset({"replica-start", "replica-stop", "benchmark"})
PHASES = ("single", "pair", "failure")
STOPPED_RANK = 1  # the failure phase stops the replica of the pair's rank 1
# A stop in one of these states is taken to end the replica; a failed or cancelled one is not.
_STOPPING = frozenset({JobState.QUEUED, *JOB_ACTIVE, JobState.SUCCEEDED})


@dataclass(frozen=True)
class Replica:
    """A replica of the pair that is starting (its replica-start job is queued or running) or running (the job
    succeeded and no stop has been queued for that rank since); its vLLM and probe outlive the job."""

    rank: int
    state: Literal["starting", "running"]
    start: models.Job


def token(settings: Settings, experiment_id: uuid.UUID) -> str:
    secret = keys.load_secret(settings.home)
    return keys.derive(secret, f"coop serving token {experiment_id}").hex()


async def pair_hosts(session: AsyncSession, experiment_id: uuid.UUID) -> dict[int, uuid.UUID]:
    """Rank -> agent of the clean-pair training generation that succeeded (each holds that rank's checkpoint)."""
    job = await session.scalar(
        select(models.Job).where(
            models.Job.experiment_id == experiment_id,
            models.Job.kind == "train",
            models.Job.arm == SERVED_ARM,
            models.Job.state == JobState.SUCCEEDED.value,
        )
    )
    if job is None:
        raise Refused("serving-requires-trained-pair", "no clean-pair training succeeded")
    return {attempt.rank: attempt.agent_id for attempt in await experiments.generation(session, job)}


async def _probes(session: AsyncSession, experiment_id: uuid.UUID) -> dict[int, str]:
    """Rank -> the probe URL of its running replica (as its replica-start job reported it)."""
    found = {}
    for rank, replica in (await replicas(session, experiment_id)).items():
        if replica.state == "running":
            (result,) = await experiments.results_of(session, replica.start)
            found[rank] = str(result["probe_url"])
    return found


async def replicas(session: AsyncSession, experiment_id: uuid.UUID) -> dict[int, Replica]:
    """Rank -> its replica, for the ranks whose replica is starting or running."""
    rows = list(
        await session.scalars(
            select(models.Job)
            .where(models.Job.experiment_id == experiment_id, models.Job.kind.in_(("replica-start", "replica-stop")))
            .order_by(models.Job.queued_at)
        )
    )
    found: dict[int, Replica] = {}
    for job in rows:
        rank, state = int(job.spec["rank"]), JobState(job.state)
        if job.kind == "replica-start" and state in {JobState.QUEUED, *JOB_ACTIVE}:
            found[rank] = Replica(rank, "starting", job)
        elif job.kind == "replica-start" and state == JobState.SUCCEEDED:
            found[rank] = Replica(rank, "running", job)
        elif job.kind == "replica-stop" and state in _STOPPING and rank in found and found[rank].state == "running":
            del found[rank]
    return found


def _checked_spec(kind: str, spec: dict[str, Any], ranks: list[int]) -> dict[str, Any]:
    if kind == "benchmark":
        if set(spec) != {"phase"} or spec["phase"] not in PHASES:
            raise Refused("serving-spec", f'a benchmark job\'s spec is exactly {{"phase": P}}, P one of {PHASES}')
        return spec
    rank = spec.get("rank")
    if set(spec) != {"rank"} or not isinstance(rank, int) or isinstance(rank, bool) or rank not in ranks:
        raise Refused("serving-spec", f"a {kind} job's spec is exactly {{\"rank\": R}}, R one of the pair's {ranks}")
    return spec


async def enqueue(
    session: AsyncSession, settings: Settings, experiment: models.Experiment, kind: str, spec: dict[str, Any]
) -> models.Job:
    """Queue one serving job on the host it belongs to (a replica's host; the benchmark on rank 0's). A replica
    is started only where none is starting or running, and stopped only where one runs."""
    hosts = await pair_hosts(session, experiment.id)
    spec = _checked_spec(kind, spec, sorted(hosts))
    if kind in {"replica-start", "replica-stop"}:
        rank = int(spec["rank"])
        replica = (await replicas(session, experiment.id)).get(rank)
        if kind == "replica-start" and replica is not None:
            raise Refused("replica-running", f"rank {rank}'s replica is already {replica.state}")
        if kind == "replica-stop" and (replica is None or replica.state != "running"):
            raise Refused(
                "replica-not-running",
                f"no replica of rank {rank} is running (a starting one is stopped by cancelling its replica-start job)",
            )
    if kind == "benchmark":
        probes = await _probes(session, experiment.id)
        ranks = [0] if spec["phase"] == "single" else [0, STOPPED_RANK]
        missing = [rank for rank in ranks if rank not in probes]
        if missing:
            raise Refused("benchmark-requires-replicas", f"no replica runs for rank(s) {missing} of the pair")
        spec = {**spec, "endpoints": [probes[rank] for rank in ranks]}
        pinned = hosts[0]
    else:
        pinned = hosts[int(spec["rank"])]
    body = wire.JobCreate(kind=kind, arm=SERVED_ARM, spec=spec)  # type: ignore[arg-type]
    return await experiments.enqueue(session, settings, experiment, body, pinned=pinned)


async def on_events(session: AsyncSession, settings: Settings, job: models.Job, kinds: set[str]) -> None:
    """The failure phase's benchmark announced the completions after which a replica is stopped."""
    if job.kind != "benchmark" or job.spec.get("phase") != "failure" or "stop-replica" not in kinds:
        return
    experiment = await experiments.load(session, job.experiment_id, lock=True)
    replica = (await replicas(session, experiment.id)).get(STOPPED_RANK)
    if replica is not None and replica.state == "running":  # else its stop is already queued, or it is gone
        await enqueue(session, settings, experiment, "replica-stop", {"rank": STOPPED_RANK})
