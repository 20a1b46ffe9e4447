"""The time each phase of a `make run` took, from what the run printed: `coop-server experiment watch`'s JSON lines
(each job's first `running` and its `succeeded`) and, when given, `vmstat -n -t 15` beside it for how busy the cores
were in each phase. Prints one JSON object.

Usage: python bench/run_phases.py --log RUN.log [--vmstat VMSTAT.log] [--wall-seconds S]"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The phases in the order the reference design runs them: a job belongs to the first whose pattern it matches.
PHASES = (
    ("prepare", r"^prepare"),
    ("train singles", r"^train (clean|damaged)-single"),
    ("train pair", r"^train clean-pair"),
    ("dev evaluations", r"^evaluate dev"),
    ("select (verify final checkpoints)", r"^select"),
    ("test evaluations", r"^evaluate test"),
    ("replicas start (identity check)", r"^replica-start"),
    ("serving benchmarks", r"^benchmark"),
    ("replicas stop", r"^replica-stop"),
    ("report", r"^report"),
)


@dataclass
class Job:
    what: str
    started: float
    ended: float | None = None
    state: str = "running"


def _jobs(log: Path) -> tuple[list[Job], float | None, float | None]:
    jobs: dict[str, Job] = {}
    committed = reported = None
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") != "progress":
            continue
        what, state, at = event["what"], str(event["state"]), float(event["at"])
        if what == "experiment":
            committed = at if state == "committed" and committed is None else committed
            reported = at if state == "reported" else reported
            continue
        if state.startswith("running") and what not in jobs:
            jobs[what] = Job(what, at)
        elif state in {"succeeded", "failed", "cancelled"} and what in jobs:
            jobs[what].ended, jobs[what].state = at, state
    return list(jobs.values()), committed, reported


def _busy(vmstat: Path | None) -> list[tuple[float, float]]:
    """(time, percent of the cores busy) for each vmstat sample: 100 less idle and waiting."""
    if vmstat is None:
        return []
    samples = []
    for line in vmstat.read_text().splitlines():
        fields = line.split()
        if len(fields) < 19 or not fields[0].isdigit():
            continue
        at = datetime.datetime.fromisoformat(f"{fields[-2]}T{fields[-1]}").replace(tzinfo=datetime.UTC)
        samples.append((at.timestamp(), 100.0 - float(fields[14]) - float(fields[15])))
    return samples


def phases(log: Path, vmstat: Path | None) -> dict[str, Any]:
    jobs, committed, reported = _jobs(log)
    busy = _busy(vmstat)
    rows = []
    for name, pattern in PHASES:
        members = [job for job in jobs if re.search(pattern, job.what)]
        if not members:
            continue
        start = min(job.started for job in members)
        end = max(job.ended or job.started for job in members)
        inside = [percent for at, percent in busy if start < at <= end]
        rows.append(
            {
                "phase": name,
                "jobs": len(members),
                "seconds": round(end - start, 1),
                "job_seconds": {job.what: round((job.ended or job.started) - job.started, 1) for job in members},
                "cores_busy_percent": round(sum(inside) / len(inside), 1) if inside else None,
            }
        )
    return {
        "committed_to_reported_seconds": round(reported - committed, 1) if committed and reported else None,
        "phases": rows,
        "failed_jobs": [job.what for job in jobs if job.state != "succeeded"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, required=True, help="what make run printed")
    parser.add_argument("--vmstat", type=Path, help="vmstat -n -t 15, run beside it")
    parser.add_argument("--wall-seconds", type=float, help="the whole command's wall time, set-up included")
    args = parser.parse_args()
    result = {"bench": "run_phases", "log": str(args.log), **phases(args.log, args.vmstat)}
    if args.wall_seconds is not None:
        result["wall_seconds"] = args.wall_seconds
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
