"""The serving benchmark's phases as the pages show them: the latest recorded report of each phase decoded into
the benchmark's own ``PhaseResult``, compared side by side, the latency of every request by phase, and the
failure phase's requests on a timeline. The report page compares the report's metrics with the same rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from experiment import wire
from experiment.core.canonical import JsonObject
from experiment.report.spans import Span, TimelineFigure
from experiment.serving.servingrecord import PHASES, Attempt, PhaseResult
from server.web import charts


@dataclass(frozen=True)
class Measure:
    label: str
    field: str  # a field of experiment.serving.servingrecord.Metrics (the report's serving.phases[PHASE])
    spec: str  # its format: "d" for a count


MEASURES = (
    Measure("requests", "requests", "d"),
    Measure("completed", "completed", "d"),
    Measure("correct", "correct", "d"),
    Measure("lost (no attempt answered)", "failed", "d"),
    Measure("requests per second", "request_throughput", ".2f"),
    Measure("output tokens per second", "output_throughput", ".1f"),
    Measure("p50 end-to-end latency (ms)", "median_e2el_ms", ".0f"),
    Measure("p95 end-to-end latency (ms)", "p95_e2el_ms", ".0f"),
    Measure("p99 end-to-end latency (ms)", "p99_e2el_ms", ".0f"),
    Measure("first attempts failed", "first_attempt_failures", "d"),
    Measure("retries", "retries", "d"),
    Measure("duration (s)", "duration", ".2f"),
)


@dataclass(frozen=True)
class Row:
    measure: Measure
    cells: list[str]  # one per phase, in the table's column order


def _cell(value: object, spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)  # a report written by another version: shown as it is
    return format(int(value) if spec == "d" else float(value), spec)


def comparison(metrics: Mapping[str, Mapping[str, Any] | None]) -> list[Row]:
    """One row per measure, one cell per phase in ``metrics``' order; a phase without metrics (not run) is blank,
    a measure a phase's metrics lack reads "not recorded"."""

    def cell(found: Mapping[str, Any] | None, measure: Measure) -> str:
        if found is None:
            return ""
        return _cell(found[measure.field], measure.spec) if measure.field in found else "not recorded"

    return [Row(measure, [cell(found, measure) for found in metrics.values()]) for measure in MEASURES]


@dataclass(frozen=True)
class Phase:
    name: str
    records: list[wire.ServingResult]  # every recorded report of this phase, oldest first
    result: PhaseResult | None  # the latest one, decoded
    problem: str | None  # why the latest could not be decoded

    @property
    def latest(self) -> wire.ServingResult | None:
        return self.records[-1] if self.records else None

    @property
    def metrics(self) -> Mapping[str, Any] | None:
        """The latest record's metrics; read as they are where the whole report could not be decoded (one from
        an older benchmark), so that its numbers still show beside the others."""
        if self.result is not None:
            return msgspec.structs.asdict(self.result.metrics)
        found = self.latest.report.get("metrics") if self.latest is not None else None
        return found if isinstance(found, Mapping) else None


@dataclass(frozen=True)
class Tried:
    """One attempt of a failure-phase request; requests are numbered in the order of their first attempt."""

    request: int
    attempt: Attempt


@dataclass(frozen=True)
class Serving:
    phases: list[Phase]  # every phase, recorded or not, in the benchmark's order
    rows: list[Row]
    latency: str | None
    failure: PhaseResult | None
    timeline: str | None
    tried: list[Tried]


def _decode(report: JsonObject) -> tuple[PhaseResult | None, str | None]:
    try:
        return msgspec.convert(report, type=PhaseResult), None
    except msgspec.ValidationError as exc:
        return None, f"its report is not one the benchmark writes ({exc})"


def _phases(results: Sequence[wire.ServingResult]) -> list[Phase]:
    found = []
    for name in PHASES:
        records = [result for result in results if result.phase == name]
        result, problem = _decode(records[-1].report) if records else (None, None)
        found.append(Phase(name, records, result, problem))
    return found


def _tried(result: PhaseResult) -> list[Tried]:
    number: dict[str, int] = {}
    found = []
    for attempt in sorted(result.attempts, key=lambda a: (a.started, a.attempt)):
        request = number.setdefault(attempt.request_id, len(number) + 1)
        found.append(Tried(request, attempt))
    return sorted(found, key=lambda tried: (tried.request, tried.attempt.attempt))


def _timeline(result: PhaseResult, tried: Sequence[Tried]) -> str | None:
    spans = [
        Span(
            str(t.request),
            t.attempt.started,
            t.attempt.ended,
            t.attempt.endpoint or "no endpoint healthy",
            t.attempt.status != 200,
        )
        for t in tried
    ]
    seen = None if result.stop_seen is None else (result.stop_seen, "the client saw a replica leave")
    return charts.timeline(
        TimelineFigure(
            "Failure phase: every attempt of every request",
            tuple(spans),
            "seconds since the phase started",
            ylabel="request (in order of its first attempt)",
            groups=tuple(result.endpoints),
            marker=seen,
            failed_label="attempt failed",
        )
    )


def view(results: Sequence[wire.ServingResult]) -> Serving:
    """The serving page's phases and figures. Drawing takes a while: the page calls it in a worker thread."""
    phases = _phases(results)
    decoded = {phase.name: phase.result for phase in phases if phase.result is not None}
    rows = comparison({phase.name: phase.metrics for phase in phases})
    latency = charts.distributions(
        "End-to-end latency of every request, by phase",
        {name: [c.e2el_ms for c in result.completions] for name, result in decoded.items()},
        "milliseconds",
    )
    failure = decoded.get("failure")
    tried = _tried(failure) if failure is not None else []
    timeline = _timeline(failure, tried) if failure is not None else None
    return Serving(phases, rows, latency, failure, timeline, tried)
