"""The operator's commands over REST (``coop-server experiment ...``): create, advance, autopilot, watch.

``watch`` follows an experiment until it is reported, failed or halted: a progress bar per job on a
terminal, JSON-lines events otherwise, then the primary verdict with its three conditions.
"""

from __future__ import annotations

import filecmp
import json
import os
import ssl
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec

from experiment import wire
from experiment.core.canonical import JsonObject
from experiment.core.errors import CoopError
from experiment.core.states import JobState
from experiment.report.model import read_report

FINAL = {"reported", "failed", "halted"}


T = TypeVar("T")


class Operator:
    def __init__(self, base_url: str, token: str | None, verify: ssl.SSLContext | bool = True) -> None:
        """``token``: None reads without one (public reads). ``verify``: the context an https coordinator's
        certificate is checked with (True: the system's CAs)."""
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, verify=verify)

    def _refusal(self, method: str, path: str, response: httpx.Response) -> CoopError:
        try:
            problem = response.json()
            detail = f"{problem.get('detail')}" + (f" (rule {problem['rule']})" if problem.get("rule") else "")
        except ValueError:
            detail = response.text[:500]
        return CoopError(f"{method} {path}: HTTP {response.status_code}: {detail}")

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        try:
            response = self.http.request(method, path, json=body, timeout=60.0)
        except httpx.TransportError as exc:
            raise CoopError(f"the coordinator at {self.http.base_url} did not answer: {exc}") from exc
        if response.status_code >= 400:
            raise self._refusal(method, path, response)
        return response.json()

    def _call(self, kind: type[T], method: str, path: str, body: Any = None) -> T:
        """The coordinator's answer to ``method path`` as ``kind``."""
        return msgspec.convert(self._json(method, path, body), type=kind)

    def experiments(self) -> list[wire.Experiment]:
        return self._call(list[wire.Experiment], "GET", "/api/experiments")

    def arms(self, experiment_id: uuid.UUID) -> list[wire.Arm]:
        return self._call(list[wire.Arm], "GET", f"/api/experiments/{experiment_id}/arms")

    def halt(self, experiment_id: uuid.UUID) -> wire.Experiment:
        return self._call(wire.Experiment, "POST", f"/api/experiments/{experiment_id}/halt")

    def export(self, experiment_id: uuid.UUID, out: Path) -> int:
        """The evidence tar into ``out``, which is never overwritten: a file there already must hold the same
        bytes (an export repeated), else it is refused. Returns the tar's size."""
        path = f"/api/experiments/{experiment_id}/evidence.tar"
        if not out.parent.is_dir():
            raise CoopError(f"cannot write {out}: {out.parent} is not a folder")
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", delete=False) as partial:
            try:
                with self.http.stream("GET", path, timeout=60.0) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise self._refusal("GET", path, response)
                    for chunk in response.iter_bytes():
                        partial.write(chunk)
            except httpx.TransportError as exc:
                Path(partial.name).unlink()
                raise CoopError(f"the coordinator at {self.http.base_url} did not answer: {exc}") from exc
            except CoopError:
                Path(partial.name).unlink()
                raise
        written = Path(partial.name)
        try:
            os.link(written, out)  # never replaces: fails if ``out`` exists
        except FileExistsError:
            same = out.is_file() and filecmp.cmp(written, out, shallow=False)
            if not same:
                raise CoopError(
                    f"{out} already holds another file; it is never overwritten: choose another --out"
                ) from None
        finally:
            written.unlink()
        return out.stat().st_size

    def create(
        self, plan: Path, autopilot: bool, commit: bool = True, canary_override: str | None = None
    ) -> wire.Experiment:
        try:
            text = plan.read_text()
        except OSError as exc:
            raise CoopError(f"cannot read plan {plan}: {exc.strerror}") from exc
        body: dict[str, Any] = {"plan_toml": text, "autopilot": autopilot, "commit": commit}
        if canary_override is not None:
            body["canary_override"] = canary_override
        return self._call(wire.Experiment, "POST", "/api/experiments", body)

    def commit(self, experiment_id: uuid.UUID, canary_override: str | None) -> wire.Experiment:
        body = {} if canary_override is None else {"canary_override": canary_override}
        return self._call(wire.Experiment, "POST", f"/api/experiments/{experiment_id}/commit", body)

    def queue(self, experiment_id: uuid.UUID, kind: str) -> wire.Job:
        return self._call(wire.Job, "POST", f"/api/experiments/{experiment_id}/jobs", {"kind": kind})

    def canary(self, experiment_id: uuid.UUID) -> wire.Canary:
        return self._call(wire.Canary, "GET", f"/api/experiments/{experiment_id}/canary")

    def step_events(self, job_id: uuid.UUID) -> list[tuple[int, JsonObject]]:
        """The canary steps each rank's attempts reported so far, as (rank, step)."""
        found = []
        for attempt in self._json("GET", f"/api/jobs/{job_id}/attempts"):
            events = self._json("GET", f"/api/attempts/{attempt['id']}/events?kind=canary-step")["items"]
            found += [(int(attempt["rank"]), event["body"]) for event in events]
        return found

    def advance(self, experiment_id: uuid.UUID) -> wire.Advanced:
        return self._call(wire.Advanced, "POST", f"/api/experiments/{experiment_id}/advance")

    def autopilot(self, experiment_id: uuid.UUID, on: bool) -> wire.Experiment:
        return self._call(wire.Experiment, "POST", f"/api/experiments/{experiment_id}/autopilot", {"on": on})

    def experiment(self, experiment_id: uuid.UUID) -> wire.Experiment:
        return self._call(wire.Experiment, "GET", f"/api/experiments/{experiment_id}")

    def jobs(self, experiment_id: uuid.UUID) -> list[wire.Job]:
        return self._call(list[wire.Job], "GET", f"/api/experiments/{experiment_id}/jobs")

    def progress(self, job: wire.Job) -> tuple[int, int]:
        """(done, total) updates of a job's current attempt, from its rank-0 step events (a train job's)."""
        attempts = self._json("GET", f"/api/jobs/{job.id}/attempts")
        current = [a for a in attempts if a["number"] == job.attempts_made and a["rank"] == 0]
        if not current:
            return 0, 0
        events = self._json("GET", f"/api/attempts/{current[0]['id']}/events?kind=step")["items"]
        steps = [e["body"] for e in events]
        if not steps:
            return 0, 0
        return int(steps[-1].get("done", 0)), int(steps[-1].get("total", 0))

    def report(self, experiment_id: uuid.UUID) -> JsonObject:
        reply: JsonObject = self._json("GET", f"/api/experiments/{experiment_id}/report")
        return reply


def listing(experiments: list[wire.Experiment]) -> list[str]:
    """One line an experiment, newest last: id, state, name, when it was created."""
    return [
        f"{e.id}  {e.state:<10} {e.name}  {e.created_at.isoformat(timespec='seconds')}"
        for e in sorted(experiments, key=lambda e: e.created_at)
    ]


def _label(job: wire.Job) -> str:
    return " ".join(part for part in (job.kind, job.role, job.arm) if part)


def watch(operator: Operator, experiment_id: uuid.UUID, poll: float = 2.0) -> wire.Experiment:
    """Follow the experiment until it ends; progress bars on a terminal, JSON lines otherwise."""
    if sys.stdout.isatty():
        return _watch_terminal(operator, experiment_id, poll)
    return _watch_lines(operator, experiment_id, poll, lambda line: print(line, flush=True))


def _snapshot(operator: Operator, experiment_id: uuid.UUID) -> tuple[wire.Experiment, list[tuple[wire.Job, int, int]]]:
    experiment = operator.experiment(experiment_id)
    rows = []
    for job in operator.jobs(experiment_id):
        # A running job's updates, where its command prints ``step`` events (train jobs); (0, 0) otherwise.
        done, total = operator.progress(job) if job.state == JobState.RUNNING else (0, 0)
        rows.append((job, done, total))
    return experiment, rows


def _watch_lines(
    operator: Operator, experiment_id: uuid.UUID, poll: float, out: Callable[[str], None]
) -> wire.Experiment:
    seen: dict[str, str] = {}
    while True:
        experiment, rows = _snapshot(operator, experiment_id)
        status = {"experiment": experiment.state} | {
            f"{_label(job)} [{str(job.id)[-6:]}]": job.state + (f" {done}/{total}" if total else "")
            for job, done, total in rows
        }
        for key, value in status.items():
            if seen.get(key) != value:
                out(json.dumps({"event": "progress", "what": key, "state": value, "at": round(time.time(), 1)}))
        seen = status
        if experiment.state in FINAL:
            return experiment
        time.sleep(poll)


def _watch_terminal(operator: Operator, experiment_id: uuid.UUID, poll: float) -> wire.Experiment:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as bars:
        phase = bars.add_task("experiment: draft", total=None)
        tasks: dict[uuid.UUID, Any] = {}
        while True:
            experiment, rows = _snapshot(operator, experiment_id)
            bars.update(phase, description=f"experiment: {experiment.state}")
            for job, done, total in rows:
                finished = job.state in {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
                description = f"  {_label(job)}: {job.state}"
                if job.id not in tasks:
                    tasks[job.id] = bars.add_task(description, total=total or 1)
                size = total or 1
                bars.update(tasks[job.id], description=description, total=size, completed=size if finished else done)
            if experiment.state in FINAL:
                return experiment
            time.sleep(poll)


def run_canary(operator: Operator, experiment_id: uuid.UUID, poll: float = 2.0) -> wire.Canary:
    """Queue a canary on the draft and follow it: one JSON line per step as each host ends it, then the verdict."""
    job = operator.queue(experiment_id, "canary")
    print(json.dumps({"event": "canary-queued", "experiment": str(experiment_id), "job": str(job.id)}), flush=True)
    seen: set[str] = set()
    while True:
        canary = operator.canary(experiment_id)
        for rank, step in operator.step_events(job.id):
            key = json.dumps([rank, step], sort_keys=True)
            if key not in seen:
                seen.add(key)
                shown = {k: step.get(k) for k in ("name", "passed", "seconds", "failure")}
                print(json.dumps({"event": "canary-step", "rank": rank, **shown}), flush=True)
        if canary.state not in {JobState.QUEUED, JobState.LEASED, JobState.RUNNING}:
            return canary
        time.sleep(poll)


def canary_lines(canary: wire.Canary) -> list[str]:
    """The verdict, then each host's steps (a failed one with its reason and fix)."""
    lines = [f"canary {'PASSED' if canary.passed else 'FAILED'} (job {canary.job_id}, {canary.state})"]
    for host in canary.hosts:
        lines.append(f"  rank {host.rank} on {host.agent}: {host.state}" + (f": {host.reason}" if host.reason else ""))
        for step in host.steps:
            lines.append(f"    {'ok  ' if step.passed else 'FAIL'} {step.name:<13} {step.seconds:8.1f} s")
            if not step.passed:
                lines.append(f"         {step.failure}")
                lines.append(f"         fix: {step.fix}")
    return lines


def verdict_lines(recorded: JsonObject) -> list[str]:
    try:
        judged, verdict = read_report(recorded).verdict()
    except (msgspec.ValidationError, CoopError) as exc:
        return [f"the recorded report is not in the shape this command reads: {exc}"]
    lines = [f"verdict ({judged}): {'PASSED' if verdict.passed else 'NOT PASSED'}"]
    for condition in verdict.conditions:
        mark = "ok  " if condition.passed else "FAIL"
        lines.append(f"  {mark} {condition.name}: {condition.value} (threshold {condition.threshold})")
    return lines
