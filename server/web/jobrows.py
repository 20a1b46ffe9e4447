"""The jobs page's account of the work: what each job is (a benchmark's phase, a replica's rank), the hosts of
its latest attempt, how long it took, and a timeline of every attempt on each host.

Times, all as recorded: an attempt runs from its creation (the claim) to its ``finished_at`` (set when it
reached a final state), or to now while it is active; a job from its first attempt's claim to its own move to a
final state. The coordinator's own job (the report) has attempts like any other, in the coordinator's lane."""

from __future__ import annotations

import datetime
import typing
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from experiment import wire
from experiment.core.states import JobState
from experiment.report.spans import Span, TimelineFigure
from server import models
from server.dispatch.lifecycle import JOB_ACTIVE, JOB_FINAL
from server.store.pages import COORDINATOR, AttemptRow, StateChange
from server.web import charts

# The spec field that tells apart one kind's jobs for one arm, and how the page says it.
_DETAIL = {
    "benchmark": ("phase", "{} phase"),
    "replica-start": ("rank", "rank {}"),
    "replica-stop": ("rank", "rank {}"),
}
KINDS: tuple[str, ...] = typing.get_args(wire.JobKind)  # the timeline's colours, the same on every page
_BROKEN = frozenset({JobState.FAILED, JobState.LOST})
Changes = Mapping[uuid.UUID, Sequence[StateChange]]


def name(job: models.Job) -> str:
    """``train clean-pair``, ``evaluate test seed``, ``benchmark clean-pair, failure phase``."""
    label = " ".join(part for part in (job.kind, job.role, job.arm) if part)
    detail = _DETAIL.get(job.kind)
    if detail is not None and job.spec.get(detail[0]) is not None:
        label += ", " + detail[1].format(job.spec[detail[0]])
    return label


@dataclass(frozen=True)
class JobRow:
    job: models.Job
    name: str
    hosts: list[tuple[int, str]]  # (rank, agent name) of the latest attempt: one per rank of a gang
    started_at: datetime.datetime | None
    ended_at: datetime.datetime | None
    at: datetime.datetime  # when the page was drawn: how long a job still going has been at it

    @property
    def seconds(self) -> float | None:
        if self.started_at is None:
            return None
        return ((self.ended_at or self.at) - self.started_at).total_seconds()

    @property
    def active(self) -> bool:
        return self.job.state in JOB_ACTIVE


def _by_job(attempts: Sequence[AttemptRow]) -> dict[uuid.UUID, list[AttemptRow]]:
    found: dict[uuid.UUID, list[AttemptRow]] = {}
    for row in attempts:
        found.setdefault(row.attempt.job_id, []).append(row)
    return found


def _started(tried: Sequence[AttemptRow], moves: Sequence[StateChange]) -> datetime.datetime | None:
    first = min((row.attempt.created_at for row in tried), default=None)
    return first or next((move.at for move in moves if move.before == JobState.QUEUED), None)


def _ended(job: models.Job, tried: Sequence[AttemptRow], moves: Sequence[StateChange]) -> datetime.datetime | None:
    if job.state not in JOB_FINAL:
        return None
    if moves:
        return moves[-1].at  # a final state has no way out: the last change is the move into it
    return max((row.attempt.finished_at for row in tried if row.attempt.finished_at), default=None)


def rows(
    jobs: Sequence[models.Job], attempts: Sequence[AttemptRow], changes: Changes, at: datetime.datetime
) -> list[JobRow]:
    by_job = _by_job(attempts)
    found = []
    for job in jobs:
        tried = by_job.get(job.id, [])
        latest = max((row.attempt.number for row in tried), default=None)
        hosts = sorted((row.attempt.rank, row.agent) for row in tried if row.attempt.number == latest)
        moves = changes.get(job.id, [])
        found.append(JobRow(job, name(job), hosts, _started(tried, moves), _ended(job, tried, moves), at))
    return found


@dataclass(frozen=True)
class Timeline:
    svg: str | None
    lanes: list[tuple[str, int]]  # each lane (a host, or the coordinator) and the attempts drawn in it
    seconds: float  # from the first claim to the last end


def unit(seconds: float) -> tuple[float, str]:
    """The unit a span of ``seconds`` reads best in on a figure's time axis: its size in seconds, and its name."""
    if seconds > 3 * 3600:
        return 3600.0, "hours"
    if seconds > 180:
        return 60.0, "minutes"
    return 1.0, "seconds"


def timeline(
    jobs: Sequence[models.Job], attempts: Sequence[AttemptRow], changes: Changes, at: datetime.datetime
) -> Timeline:
    """One lane per host (agent name, in name order, then the coordinator), one bar per attempt, coloured by its
    job's kind and hatched where it failed or was lost."""
    kind = {job.id: job.kind for job in jobs}
    bars: list[tuple[str, datetime.datetime, datetime.datetime, str, bool]] = []
    for row in attempts:
        attempt = row.attempt
        end = attempt.finished_at or (at if row.active else attempt.updated_at)
        bars.append((row.agent, attempt.created_at, end, kind[attempt.job_id], attempt.state in _BROKEN))
    if not bars:
        return Timeline(None, [], 0.0)
    lanes = sorted({bar[0] for bar in bars}, key=lambda lane: (lane == COORDINATOR, lane))
    origin = min(bar[1] for bar in bars)
    seconds = (max(bar[2] for bar in bars) - origin).total_seconds()
    scale, named = unit(seconds)
    spans = [
        Span(lane, (start - origin).total_seconds() / scale, (end - origin).total_seconds() / scale, group, broken)
        for lane, start, end, group, broken in sorted(bars, key=lambda bar: (lanes.index(bar[0]), bar[1]))
    ]
    svg = charts.timeline(
        TimelineFigure(
            "Attempts on each host",
            tuple(spans),
            f"{named} since the first claim",
            groups=KINDS,
            failed_label="failed or lost",
        )
    )
    counts = [(lane, sum(1 for bar in bars if bar[0] == lane)) for lane in lanes]
    return Timeline(svg, counts, seconds)
