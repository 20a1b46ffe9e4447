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
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import experiments, models
from server.lifecycle import SERVED_ARM, JobState, Refused
from server.settings import Settings
from server.web import keys

KINDS = frozenset({"replica-start", "replica-stop", "benchmark"})
STOPPED_RANK = 1  # the failure phase stops the replica of the pair's rank 1


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
    """Rank -> the probe URL its succeeded replica-start job reported."""
    rows = await session.scalars(
        select(models.Job).where(
            models.Job.experiment_id == experiment_id,
            models.Job.kind == "replica-start",
            models.Job.state == JobState.SUCCEEDED.value,
        )
    )
    found = {}
    for job in rows:
        (result,) = await experiments.results_of(session, job)
        found[int(job.spec["rank"])] = str(result["probe_url"])
    return found


async def enqueue(
    session: AsyncSession, settings: Settings, experiment: models.Experiment, kind: str, spec: dict[str, Any]
) -> models.Job:
    """Queue one serving job on the host it belongs to (a replica's host; the benchmark on rank 0's)."""
    hosts = await pair_hosts(session, experiment.id)
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
    queued = await session.scalar(
        select(models.Job).where(models.Job.experiment_id == experiment.id, models.Job.kind == "replica-stop")
    )
    if queued is None:
        await enqueue(session, settings, experiment, "replica-stop", {"rank": STOPPED_RANK})
