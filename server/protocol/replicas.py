"""The serving phase's jobs: which host each runs on, what each is given, and the mid-phase stop.

Both hosts of the pair start a replica of the served arm's selected final checkpoint (each from its own rank's
copy) behind its probe; rank 0's host then benchmarks the single phase (its own probe), the pair phase (both) and
the failure phase (both), in which the coordinator stops rank 1's replica as soon as the benchmark reports the set
number of completions (its ``stop-replica`` event); finally both replicas are stopped. The probes' bearer token is
derived from the coordinator's secret per experiment and handed only to the agents that claim a serving job
(server.access.secret); it is stored nowhere.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core.states import JobState
from experiment.learning.events import StopReplicaEvent, name_of
from server import models
from server.dispatch import queue
from server.dispatch.lifecycle import JOB_ACTIVE, Refused
from server.protocol import recording
from server.store import views

STOPPED_RANK = 1  # the failure phase stops the replica of the pair's rank 1
STOP_SIGNAL = name_of(StopReplicaEvent)  # the event the failure phase's benchmark prints when the replica is to stop
# A stop in one of these states is taken to end the replica; a failed or cancelled one is not.
_STOPPING = frozenset({JobState.QUEUED, *JOB_ACTIVE, JobState.SUCCEEDED})
_LIVE = frozenset({JobState.QUEUED, *JOB_ACTIVE})


@dataclass(frozen=True)
class Replica:
    """A replica of the pair that is starting (its replica-start job is queued or running) or running (the job
    succeeded and no stop has been queued for that rank since); its vLLM and probe outlive the job."""

    rank: int
    state: Literal["starting", "running"]
    start: models.Job


async def pair_hosts(session: AsyncSession, experiment: models.Experiment) -> dict[int, uuid.UUID]:
    """Rank -> agent of the served arm's training generation that succeeded (each holds that rank's checkpoint)."""
    served = views.plan_of(experiment).served_arm()
    job = await session.scalar(
        select(models.Job).filter_by(experiment_id=experiment.id, kind="train", arm=served, state=JobState.SUCCEEDED)
    )
    if job is None:
        raise Refused("serving-requires-trained-pair", f"no {served} training succeeded")
    ranks = await queue.generation(session, job)
    return {attempt.rank: attempt.agent_id for attempt in ranks if attempt.agent_id is not None}


async def replicas(session: AsyncSession, experiment_id: uuid.UUID) -> dict[int, Replica]:
    """Rank -> its replica, for the ranks whose replica is starting or running."""
    rows = await session.scalars(
        select(models.Job)
        .where(models.Job.experiment_id == experiment_id, models.Job.kind.in_(("replica-start", "replica-stop")))
        .order_by(models.Job.queued_at)
    )
    found: dict[int, Replica] = {}
    for job in rows:
        state = job.state
        match wire.spec_of(job.kind, job.spec):
            case wire.ReplicaStartSpec(rank=rank) if state in _LIVE:
                found[rank] = Replica(rank, "starting", job)
            case wire.ReplicaStartSpec(rank=rank) if state == JobState.SUCCEEDED:
                found[rank] = Replica(rank, "running", job)
            case wire.ReplicaStopSpec(rank=rank) if state in _STOPPING and rank in found:
                if found[rank].state == "running":
                    del found[rank]
    return found


async def _probes(session: AsyncSession, experiment_id: uuid.UUID) -> dict[int, str]:
    """Rank -> the probe URL of its running replica (as its replica-start job reported it)."""
    found = {}
    for rank, replica in (await replicas(session, experiment_id)).items():
        if replica.state == "running":
            results = await recording.results_of(session, replica.start)
            (started,) = recording.decoded(results, wire.ReplicaStartResult, replica.start)
            found[rank] = started.probe_url
    return found


def _chosen_by_the_operator(spec: wire.ServingSpec) -> None:
    """An operator names a replica's rank or a benchmark's phase; the rest is the coordinator's to fill in."""
    if spec.serving_token is not None or (isinstance(spec, wire.BenchmarkSpec) and spec.endpoints):
        name = wire.kind_of(spec)
        raise Refused(
            "serving-spec", f"a {name} job's spec names only its rank or phase; the coordinator adds the rest"
        )


async def _rank_host(session: AsyncSession, experiment: models.Experiment, rank: int, kind: str) -> uuid.UUID:
    hosts = await pair_hosts(session, experiment)
    if rank not in hosts:
        raise Refused(
            "serving-spec", f"a {kind} job's spec is exactly {{\"rank\": R}}, R one of the pair's {sorted(hosts)}"
        )
    return hosts[rank]


async def _replica_at(
    session: AsyncSession, experiment: models.Experiment, spec: wire.ReplicaStartSpec | wire.ReplicaStopSpec
) -> tuple[uuid.UUID, Replica | None]:
    """An operator's replica job: the host of its rank, and the replica that rank has (None: none)."""
    _chosen_by_the_operator(spec)
    host = await _rank_host(session, experiment, spec.rank, wire.kind_of(spec))
    return host, (await replicas(session, experiment.id)).get(spec.rank)


async def place_replica_start(
    session: AsyncSession, experiment: models.Experiment, spec: wire.ReplicaStartSpec
) -> tuple[uuid.UUID, wire.ReplicaStartSpec]:
    """A replica starts on its rank's host, only where none is starting or running."""
    host, replica = await _replica_at(session, experiment, spec)
    if replica is not None:
        raise Refused("replica-running", f"rank {spec.rank}'s replica is already {replica.state}")
    return host, spec


async def place_replica_stop(
    session: AsyncSession, experiment: models.Experiment, spec: wire.ReplicaStopSpec
) -> tuple[uuid.UUID, wire.ReplicaStopSpec]:
    """A replica is stopped on its rank's host, only where one runs."""
    host, replica = await _replica_at(session, experiment, spec)
    if replica is None or replica.state != "running":
        raise Refused(
            "replica-not-running",
            f"no replica of rank {spec.rank} is running "
            "(a starting one is stopped by cancelling its replica-start job)",
        )
    return host, spec


async def place_benchmark(
    session: AsyncSession, experiment: models.Experiment, spec: wire.BenchmarkSpec
) -> tuple[uuid.UUID, wire.BenchmarkSpec]:
    """The benchmark runs on rank 0's host against the probes of the replicas its phase needs."""
    _chosen_by_the_operator(spec)
    hosts = await pair_hosts(session, experiment)
    probes = await _probes(session, experiment.id)
    ranks = [0] if spec.phase == "single" else [0, STOPPED_RANK]
    missing = [rank for rank in ranks if rank not in probes]
    if missing:
        raise Refused("benchmark-requires-replicas", f"no replica runs for rank(s) {missing} of the pair")
    return hosts[0], wire.BenchmarkSpec(phase=spec.phase, endpoints=[probes[rank] for rank in ranks])


async def stop_due(
    session: AsyncSession, job: models.Job, spec: wire.BenchmarkSpec, printed: set[str]
) -> wire.ReplicaStopSpec | None:
    """The replica stop the failure phase's benchmark asked for with its signal, unless it is queued or gone."""
    if spec.phase != "failure" or STOP_SIGNAL not in printed:
        return None
    replica = (await replicas(session, job.experiment_id)).get(STOPPED_RANK)
    if replica is None or replica.state != "running":
        return None
    return wire.ReplicaStopSpec(rank=STOPPED_RANK)
