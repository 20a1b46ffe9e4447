"""The hosts' resources over time: every attempt's whole-process samples (``resources`` rows of models.Measurement,
as experiment.learning.resources.Sampler takes them), drawn per host as resident memory, CPU use and, where the
samples carry it, GPU memory, with the preflight's memory figure as a line where a sample records it.

Time: a sample stands at its attempt's claim plus the seconds its sampler had counted (the sampler starts with the
command, a little after the claim), on one axis for every host, from the first sampled attempt's claim.

A GPU rank's sample also carries ``gpu`` (experiment.learning.records.GpuMemory): the memory torch has allocated
on its device, and the memory the preflight asked of the rank (experiment.learning.preflight.memory_needed)."""

from __future__ import annotations

import datetime
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from server import models
from server.store import runs
from server.store.pages import COORDINATOR
from server.web import charts, jobrows

KIND = "resources"
GPU_ALLOCATED = "gpu_allocated_bytes"  # the series' name
MAX_POINTS = 1000  # per line: a six-hour run samples every second, more than a figure can show
GIB = 2**30
MIB = 2**20

Point = tuple[float, float]


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Sample:
    seconds: float  # since its sampler started
    rss_bytes: float
    cpu_seconds: float  # user and system
    gpu: dict[str, float]  # each GPU memory field the sample carries
    preflight: float | None


def sample(body: Mapping[str, Any]) -> Sample | None:
    """A sample as recorded; None for one that lacks the Sampler's fields (from another command version)."""
    seconds, rss = _number(body, "seconds"), _number(body, "rss_bytes")
    user, system = _number(body, "cpu_user_seconds"), _number(body, "cpu_system_seconds")
    if seconds is None or rss is None or user is None or system is None:
        return None
    memory = body.get("gpu")
    if not isinstance(memory, Mapping):
        return Sample(seconds, rss, user + system, {}, None)
    allocated = _number(memory, "allocated_bytes")
    gpu = {} if allocated is None else {GPU_ALLOCATED: allocated}
    return Sample(seconds, rss, user + system, gpu, _number(memory, "preflight_bytes"))


@dataclass(frozen=True)
class Sampled:
    """One attempt's samples, in the order taken."""

    attempt: models.Attempt
    job: models.Job
    host: str
    samples: list[Sample]

    @property
    def label(self) -> str:
        return f"{jobrows.name(self.job)}, rank {self.attempt.rank}, attempt {self.attempt.number}"

    @property
    def peak_rss_bytes(self) -> float:
        return max(s.rss_bytes for s in self.samples)

    @property
    def gpu_fields(self) -> list[str]:
        return sorted({key for s in self.samples for key in s.gpu})

    def peak_gpu_bytes(self, field: str) -> float | None:
        return max((s.gpu[field] for s in self.samples if field in s.gpu), default=None)

    @property
    def preflight_bytes(self) -> float | None:
        """The latest figure a sample recorded: the rank checks it once, before its first update."""
        return next((s.preflight for s in reversed(self.samples) if s.preflight is not None), None)

    @property
    def cpu_percent(self) -> list[tuple[float, float]]:
        """(seconds, percent of one core) between each sample and the one before it."""
        found = []
        for before, after in zip(self.samples, self.samples[1:], strict=False):
            span = after.seconds - before.seconds
            if span > 0:
                found.append((after.seconds, 100 * (after.cpu_seconds - before.cpu_seconds) / span))
        return found

    @property
    def mean_cpu_percent(self) -> float | None:
        first, last = self.samples[0], self.samples[-1]
        span = last.seconds - first.seconds
        return 100 * (last.cpu_seconds - first.cpu_seconds) / span if span > 0 else None

    @property
    def seconds(self) -> float:
        return self.samples[-1].seconds - self.samples[0].seconds


async def sampled(session: AsyncSession, experiment_id: uuid.UUID) -> list[Sampled]:
    """Every attempt of the experiment that recorded resource samples, in claim order, with its samples."""
    found = await runs.sampled(session, experiment_id, KIND)
    if not found:
        return []
    rows = await runs.samples(session, KIND, [attempt.id for attempt, _, _ in found])
    by_attempt: dict[uuid.UUID, list[Sample]] = {}
    for attempt_id, body in rows:
        taken = sample(body) if isinstance(body, Mapping) else None
        if taken is not None:
            by_attempt.setdefault(attempt_id, []).append(taken)
    return [
        Sampled(attempt, job, host, by_attempt[attempt.id]) for attempt, job, host in found if attempt.id in by_attempt
    ]


def thin(points: Sequence[Point], most: int = MAX_POINTS) -> list[Point]:
    """At most about ``most`` points: beyond that, each run of neighbours is kept as its lowest and its highest
    point, in time order, so that the peaks survive."""
    if len(points) <= most:
        return list(points)
    size = math.ceil(len(points) / (most // 2))
    kept: list[Point] = []
    for start in range(0, len(points), size):
        run = points[start : start + size]
        low = min(range(len(run)), key=lambda i: run[i][1])
        high = max(range(len(run)), key=lambda i: run[i][1])
        kept.extend(run[i] for i in sorted({low, high}))
    return kept


def _bytes_unit(peak: float) -> tuple[float, str]:
    return (GIB, "GiB") if peak >= 2 * GIB else (MIB, "MiB")


@dataclass(frozen=True)
class Host:
    name: str
    attempts: list[Sampled]
    memory: str | None  # the figures' SVG
    cpu: str | None
    gpu: str | None
    preflight_on: str | None  # which figure carries the preflight's line: "gpu", "memory" or none


@dataclass(frozen=True)
class Resources:
    hosts: list[Host]
    origin: datetime.datetime | None  # the first sampled attempt's claim: where the time axis starts
    unit: str  # the time axis's unit
    samples: int


def _host(name: str, attempts: Sequence[Sampled], origin: datetime.datetime, scale: float, unit: str) -> Host:
    def at(item: Sampled, seconds: float) -> float:
        return ((item.attempt.created_at - origin).total_seconds() + seconds) / scale

    xlabel = f"{unit} since the first sampled claim"
    rss_scale, rss_unit = _bytes_unit(max(a.peak_rss_bytes for a in attempts))
    memory = {a.label: thin([(at(a, s.seconds), s.rss_bytes / rss_scale) for s in a.samples]) for a in attempts}
    cpu = {a.label: thin([(at(a, seconds), percent) for seconds, percent in a.cpu_percent]) for a in attempts}
    gpu: dict[str, list[Point]] = {}
    for a in attempts:
        for field in a.gpu_fields:
            name_of = a.label if len(a.gpu_fields) == 1 else f"{a.label}: {field}"
            gpu[name_of] = thin([(at(a, s.seconds), s.gpu[field] / GIB) for s in a.samples if field in s.gpu])
    # The preflight's figure, as a level line across the attempt that recorded it, on the GPU figure it is about,
    # or on the resident memory where the samples carry no GPU memory.
    preflight_on = "gpu" if gpu else "memory"
    lines = gpu if gpu else memory
    preflight_scale = GIB if gpu else rss_scale
    drawn = False
    for a in attempts:
        needed = a.preflight_bytes
        if needed is not None:
            level = needed / preflight_scale
            span = (at(a, a.samples[0].seconds), at(a, a.samples[-1].seconds))
            lines[f"preflight rule, {a.label}"] = [(span[0], level), (span[1], level)]
            drawn = True
    return Host(
        name=name,
        attempts=list(attempts),
        memory=charts.lines(f"{name}: resident memory", memory, xlabel, f"resident memory ({rss_unit})"),
        cpu=charts.lines(f"{name}: CPU use", cpu, xlabel, "CPU (% of one core)"),
        gpu=charts.lines(f"{name}: GPU memory", gpu, xlabel, "GPU memory (GiB)"),
        preflight_on=preflight_on if drawn else None,
    )


def view(found: Sequence[Sampled]) -> Resources:
    """The page's hosts (in name order, the coordinator last) and their figures. Drawing takes a while: the page
    calls this in a worker thread."""
    if not found:
        return Resources([], None, "seconds", 0)
    origin = min(a.attempt.created_at for a in found)
    end = max((a.attempt.created_at - origin).total_seconds() + a.samples[-1].seconds for a in found)
    scale, unit = jobrows.unit(end)
    names = sorted({a.host for a in found}, key=lambda host: (host == COORDINATOR, host))
    hosts = [_host(name, [a for a in found if a.host == name], origin, scale, unit) for name in names]
    return Resources(hosts, origin, unit, sum(len(a.samples) for a in found))
