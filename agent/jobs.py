"""One handler per job kind: the ``coop`` command line a job runs, and the result the coordinator expects from
what the command printed and wrote. Paths the coordinator's job rows do not carry come from agent settings."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from experiment import wire
from experiment.canonical import write_new_bytes
from experiment.errors import CoopError
from experiment.layout import SELECTION

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Workspace:
    """Where one experiment's files live on this host (one home per experiment, shared by its jobs)."""

    root: Path
    model_dir: Path
    # Relative replay folders of a plan (plans/local.toml: "local-reference") resolve against this folder.
    plans_dir: Path

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def plan(self) -> Path:
        return self.root / "plan.toml"


@dataclass(frozen=True)
class Outcome:
    """What a finished command contributes to its wire.AttemptResult."""

    result: dict[str, Any] = field(default_factory=dict)
    journal: list[wire.StepRecord] = field(default_factory=list)
    resource_samples: list[wire.ResourceSample] = field(default_factory=list)
    answers: list[wire.AnswerRecord] = field(default_factory=list)
    serving: list[wire.ServingPhase] = field(default_factory=list)


Argv = Callable[[wire.Assignment, Workspace], list[str]]
Collect = Callable[[wire.Assignment, Workspace, Sequence[dict[str, Any]]], Outcome]


@dataclass(frozen=True)
class Handler:
    argv: Argv
    collect: Collect


def coop(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "experiment.cli", *(str(a) for a in args)]


def _last(events: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    found: dict[str, Any] | None = next((event for event in reversed(events) if event.get("event") == name), None)
    if found is not None:
        return found
    raise CoopError(f"the command ended without its {name!r} event")


def _prepare(job: wire.Assignment, ws: Workspace) -> list[str]:
    return coop("prepare", "--plan", ws.plan, "--home", ws.home, "--model-dir", ws.model_dir)


def _prepared(job: wire.Assignment, ws: Workspace, events: Sequence[dict[str, Any]]) -> Outcome:
    return Outcome(result={"prepared_identity": _last(events, "prepared")["prepared_identity"]})


def _train(job: wire.Assignment, ws: Workspace) -> list[str]:
    return coop("train", "--home", ws.home, "--model-dir", ws.model_dir, "--arm", _arm(job))


def _trained(job: wire.Assignment, ws: Workspace, events: Sequence[dict[str, Any]]) -> Outcome:
    path = Path(_last(events, "completed")["result"])
    run = msgspec.json.decode(path.read_bytes())
    candidate = run["candidate"]
    model_dir = path.parent / "checkpoints" / candidate["checkpoint"] / "model"
    result = wire.TrainResult(
        step=candidate["step"],
        model_identity=run["parameter_digest"],
        receipt_sha256=candidate["receipt_sha256"],
        final=True,  # `coop train` prints "completed" only after the plan's last update
        binding=run["binding"],
        checkpoint_path=model_dir.relative_to(ws.home).as_posix(),
    )
    return Outcome(
        result=msgspec.to_builtins(result),
        journal=msgspec.convert(run["journal"], type=list[wire.StepRecord]),
        resource_samples=msgspec.convert(run["resource_samples"], type=list[wire.ResourceSample]),
    )


def _evaluate(job: wire.Assignment, ws: Workspace) -> list[str]:
    role = job.role or "dev"
    argv = coop("evaluate", "--home", ws.home, "--model-dir", ws.model_dir, "--arm", _arm(job), "--role", role)
    if role == "test":
        argv += ["--selection", str(ws.home / SELECTION)]
    return argv


def _evaluated(job: wire.Assignment, ws: Workspace, events: Sequence[dict[str, Any]]) -> Outcome:
    summary_path = Path(_last(events, "evaluated")["evaluation"])
    lines = (summary_path.parent / "answers.jsonl").read_bytes().splitlines()
    answers = [msgspec.json.decode(line, type=wire.AnswerRecord) for line in lines if line.strip()]
    summary = msgspec.json.decode(summary_path.read_bytes())
    return Outcome(result={"answers_sha256": summary["answers_sha256"]}, answers=answers)


def _select(job: wire.Assignment, ws: Workspace) -> list[str]:
    return coop("checkpoint", "verify", "--home", ws.home, "--arm", _arm(job), "--model-dir", ws.model_dir)


def _verified(job: wire.Assignment, ws: Workspace, events: Sequence[dict[str, Any]]) -> Outcome:
    candidate = msgspec.convert(_last(events, "verified")["candidate"], type=wire.SelectResult)
    return Outcome(result=msgspec.to_builtins(candidate))


def _replica_start(job: wire.Assignment, ws: Workspace) -> list[str]:
    # The replica serves this host's copy of the selected checkpoint: verify it first (loop.py starts it).
    return coop("checkpoint", "verify", "--home", ws.home, "--arm", _arm(job), "--model-dir", ws.model_dir)


def serving_token_file(ws: Workspace) -> Path:
    return ws.root / "serving-token"


def benchmark_output(job: wire.Assignment, ws: Workspace) -> Path:
    """Each attempt writes a file of its own: a lost attempt's report stays, and its retry never meets it.
    The bundle names the succeeded attempt's file serving/PHASE.json (evidence.written_by)."""
    return ws.home / "serving" / f"{job.spec['phase']}-attempt-{job.number}.json"


def _benchmark(job: wire.Assignment, ws: Workspace) -> list[str]:
    phase = str(job.spec["phase"])
    argv = coop("benchmark", "--phase", phase, "--home", ws.home, "--token-file", serving_token_file(ws))
    for endpoint in job.spec["endpoints"]:
        argv += ["--endpoint", str(endpoint)]
    return [*argv, "--output", str(benchmark_output(job, ws))]


def _benchmarked(job: wire.Assignment, ws: Workspace, events: Sequence[dict[str, Any]]) -> Outcome:
    report = msgspec.json.decode(Path(_last(events, "benchmarked")["output"]).read_bytes())
    phase = wire.ServingPhase(phase=job.spec["phase"], report=report)
    return Outcome(result={"phase": phase.phase, "metrics": report["metrics"]}, serving=[phase])


def _arm(job: wire.Assignment) -> str:
    if job.arm is None:
        raise CoopError(f"{job.kind} job {job.job_id} names no arm")
    return job.arm


HANDLERS: dict[str, Handler] = {
    "prepare": Handler(_prepare, _prepared),
    "train": Handler(_train, _trained),
    "evaluate": Handler(_evaluate, _evaluated),
    "select": Handler(_select, _verified),
    "replica-start": Handler(_replica_start, _verified),
    "benchmark": Handler(_benchmark, _benchmarked),
}
# Run by the agent itself, not as a command: stopping the replica and probe it keeps (services.py).
IN_PROCESS = frozenset({"replica-stop"})


def handler(kind: str) -> Handler:
    found = HANDLERS.get(kind)
    if found is None:
        raise CoopError(f"this agent runs {', '.join(sorted({*HANDLERS, *IN_PROCESS}))} jobs, not {kind}")
    return found


def environment(job: wire.Assignment, base: dict[str, str]) -> dict[str, str]:
    """The command's environment: the agent's, plus the rendezvous of a gang (torchrun's variables)."""
    env = {**base, "RANK": str(job.rank), "WORLD_SIZE": str(job.world_size), "PYTHONUNBUFFERED": "1"}
    if job.master_addr is not None and job.master_port is not None:
        env["MASTER_ADDR"], env["MASTER_PORT"] = job.master_addr, str(job.master_port)
    return env


def _without_nulls(value: Any) -> Any:
    # TOML has no null; the plan's optional fields are absent in the file and None in its builtins.
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def write_plan(entries: Sequence[wire.LedgerEntry], ws: Workspace) -> Path:
    """The committed plan, from the experiment's ledger, as a TOML file beside the home (same identity)."""
    committed = next((entry for entry in entries if entry.kind == "plan"), None)
    if committed is None:
        raise CoopError("the experiment's ledger has no committed plan")
    plan = committed.body["plan"]
    ws.root.mkdir(parents=True, exist_ok=True)
    folder = plan.get("replay", {}).get("folder")
    if folder is not None and not Path(folder).is_absolute():
        link = ws.root / folder
        if not link.exists():
            link.symlink_to((ws.plans_dir / folder).resolve(), target_is_directory=True)
    write_new_bytes(ws.plan, msgspec.toml.encode(_without_nulls(plan)))
    return ws.plan
