"""The report's serving section: the three benchmark phases checked and compared (docs/evidence.md).

Checks: each phase is for these inputs and served only the selected clean-pair model; no measured request
was answered from the probe's retry cache; no request was lost; every task got the same output tokens in
every phase; and the failure phase saw the stopped replica (a first attempt failed and was retried, or the
client went on without it: requests kept starting on the other replica after its last). The benchmark holds new
requests from the stop's announcement until it sees a replica leave, so the second holds however fast the rest
of the workload goes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiment.canonical import read_json
from experiment.corpus import Prepared

PHASES = ("single", "pair", "failure")
SERVED = "clean-pair"
Require = Callable[[bool, Path | str, str, str], None]


def section(bundle: Path, prepared: Prepared, served_identity: str, require: Require) -> dict[str, Any]:
    folder = bundle / "serving"
    reports: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        path = folder / f"{phase}.json"
        require(path.is_file(), path, "serving", "is missing (the serving commitment promises all three phases)")
        report: dict[str, Any] = read_json(path)
        require(report.get("phase") == phase, path, "phase", f"is not {phase}")
        require(report.get("prepared_identity") == prepared.identity, path, "prepared_identity", "differs")
        require(report.get("models") == [served_identity], path, "models", f"must be only the {SERVED} selection")
        metrics = report["metrics"]
        require(metrics["cache_hits"] == 0, path, "metrics.cache_hits", "a measured request came from the cache")
        require(not any(c["cached"] for c in report["completions"]), path, "completions.cached", "must all be false")
        require(metrics["failed"] == 0, path, "metrics.failed", "requests were lost")
        require(len(report["completions"]) == metrics["requests"], path, "completions", "must answer every request")
        reports[phase] = report
    outputs = {phase: {c["task_id"]: c["output_ids"] for c in r["completions"]} for phase, r in reports.items()}
    for phase in PHASES[1:]:
        path = folder / f"{phase}.json"
        require(outputs[phase] == outputs["single"], path, "completions.output_ids", "differ from the single phase")
    failure = reports["failure"]["metrics"]
    after_stop = _served_without_one(reports["failure"])
    concurrency = int(reports["failure"]["workload"]["concurrency"])
    require(
        failure["first_attempt_failures"] >= 1 or after_stop >= 2 * concurrency,
        folder / "failure.json",
        "attempts",
        "the failure phase never saw the stopped replica (no failed attempt, no requests served without it)",
    )
    single, pair = reports["single"]["metrics"], reports["pair"]["metrics"]
    return {
        "phases": {phase: reports[phase]["metrics"] for phase in PHASES},
        "pair_over_single_request_throughput": pair["request_throughput"] / single["request_throughput"],
        "failure": {
            "stopped_after_completions": reports["failure"].get("stop_after"),
            "stop_seen_at_seconds": reports["failure"].get("stop_seen"),
            "requests_started_after_one_replica_left": after_stop,
            "first_attempt_failures": failure["first_attempt_failures"],
            "retries": failure["retries"],
            "lost": failure["failed"],
        },
    }


def _served_without_one(report: dict[str, Any]) -> int:
    """Attempts started after the last one sent to the endpoint that left first: a replica stopped gracefully
    finishes what it holds and the health-aware client stops sending to it, so no attempt need fail."""
    last: dict[str, float] = {}
    for attempt in report["attempts"]:
        last[attempt["endpoint"]] = max(last.get(attempt["endpoint"], 0.0), float(attempt["started"]))
    if len(last) < 2:
        return 0
    left = min(last.values())
    return sum(1 for attempt in report["attempts"] if float(attempt["started"]) > left)
