"""One handler per job kind: what the job needs in this host's home before it runs (its staging), the ``coop``
command it runs or what the agent does itself, the result it reports from the command's final event
(experiment.learning.events) and the files it wrote, and the evidence files it contributes. The supervisor
(supervisor.py) runs every kind the same way through ``HANDLERS``; the files a new kind touches are listed in
docs/architecture.md, "Job kinds"."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

import msgspec
import psutil

from agent import evidence
from agent.services import Launch, Services
from experiment import wire
from experiment.core import layout
from experiment.core.canonical import write_new_bytes
from experiment.core.errors import EXIT_LINK, CoopError
from experiment.core.plan import Plan, confined_problem, parse_plan
from experiment.learning.events import (
    BenchmarkedEvent,
    CanariedEvent,
    CommandEvent,
    CompletedEvent,
    EvaluatedEvent,
    PreparedEvent,
    VerifiedEvent,
    name_of,
)
from experiment.learning.records import Result, Summary

ROOT = Path(__file__).resolve().parents[1]
S = TypeVar("S", bound=wire.Tagged)  # a kind's spec
R = TypeVar("R", bound=wire.Tagged)  # a kind's result
E = TypeVar("E", bound=CommandEvent)


@dataclass(frozen=True)
class Workspace:
    """Where one experiment's files live on this host (one home per experiment, shared by its jobs)."""

    root: Path
    model_dir: Path
    # Relative replay folders of a plan (plans/local.toml: "local-reference") resolve against this folder.
    plans_dir: Path
    # The previous reference run's published data, which a plan whose replay source is "reference-home" reads.
    reference_home: Path | None = None

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def plan(self) -> Path:
        return self.root / "plan.toml"


@dataclass
class Run(Generic[S]):
    """One attempt as its handler sees it: the assignment, its kind's spec, this host's workspace, and the
    experiment's ledger by kind (read when the job is staged)."""

    job: wire.Assignment
    spec: S
    ws: Workspace
    ledger: dict[str, wire.LedgerEntry] = field(default_factory=dict)

    @property
    def arm(self) -> str:
        if self.job.arm is None:
            raise CoopError(f"{self.job.kind} job {self.job.job_id} names no arm")
        return self.job.arm

    def committed(self, kind: str) -> wire.LedgerEntry:
        entry = self.ledger.get(kind)
        if entry is None:
            raise CoopError(f"a {self.job.kind} job needs the committed {kind}; the experiment's ledger has none")
        return entry

    def plan(self) -> Plan:
        return msgspec.convert(self.committed("plan").body["plan"], type=Plan)


@dataclass(frozen=True)
class Outcome(Generic[R]):
    """What a finished job contributes to its wire.AttemptResult."""

    result: R
    journal: list[wire.StepRecord] = field(default_factory=list)
    resource_samples: list[wire.ResourceSample] = field(default_factory=list)
    answers: list[wire.Answer] = field(default_factory=list)
    serving: list[wire.ServingPhase] = field(default_factory=list)


class CommandEnded(CoopError):
    """The job's command did not succeed: it exited non-zero (lost when its gang's link broke), or it was stopped."""

    def __init__(self, outcome: Literal["failed", "lost", "cancelled"], exit_code: int | None, reason: str) -> None:
        super().__init__(reason)
        self.outcome, self.exit_code, self.reason = outcome, exit_code, reason[:4000]


def failure_outcome(exit_code: int, world_size: int) -> Literal["failed", "lost"]:
    """How a command that did not succeed ended its attempt. A rank whose gang lost a peer or its link is lost, not
    failed, and the coordinator retries the gang from the checkpoint its ranks share: a gloo rank says so by exiting
    EXIT_LINK; an NCCL rank is ended by its watchdog with SIGABRT (experiment.learning.distributed's
    NCCL_ERROR_HANDLING), since NCCL raises nothing that Python could catch."""
    if exit_code == EXIT_LINK or (world_size > 1 and exit_code == -signal.SIGABRT):
        return "lost"
    return "failed"


class Host(Protocol):
    """What a handler asks of the agent running it (agent.supervisor.Supervisor)."""

    services: Services
    stopping: threading.Event

    @property
    def advertise_address(self) -> str: ...

    def ledger(self, run: Run[Any]) -> list[wire.LedgerEntry]: ...

    def fetch_prepared(self, run: Run[Any], prepared_identity: str) -> None: ...

    def fetch_folder(self, run: Run[Any], folder: str) -> None: ...

    def command(self, run: Run[Any], argv: list[str]) -> list[wire.Event]:
        """Run ``argv`` as the job's command; the events of its JSON lines. Raises CommandEnded unless it
        succeeded."""
        ...


def coop(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "experiment.cli", *(str(a) for a in args)]


def last_event(events: Sequence[wire.Event], kind: type[E]) -> E:
    """The last event of ``kind`` the command printed, decoded (a malformed one raises msgspec.ValidationError)."""
    name = name_of(kind)
    found = next((event for event in reversed(events) if event.kind == name), None)
    if found is None:
        raise CoopError(f"the command ended without its {name!r} event")
    return msgspec.convert(found.body, type=kind)


def serving_token_file(ws: Workspace) -> Path:
    return ws.root / "serving-token"


def benchmark_output(job: wire.Assignment, phase: str, ws: Workspace) -> Path:
    """Each attempt writes a file of its own: a lost attempt's report stays, and its retry never meets it.
    The bundle names the succeeded attempt's file serving/PHASE.json (Benchmark.evidence)."""
    return ws.home / layout.SERVING / f"{phase}-attempt-{job.number}.json"


class Handler(Generic[S, R]):
    """A kind's handler; by default its job reads the committed plan and prepared inputs and runs one command."""

    spec: type[S]

    def read_spec(self, job: wire.Assignment) -> S:
        return wire.decode(job.spec, self.spec)

    def stage(self, host: Host, run: Run[S]) -> None:
        """Put what the job reads into this host's home: the committed plan and the prepared inputs."""
        run.ledger = {entry.kind: entry for entry in host.ledger(run)}
        write_plan(run.committed("plan"), run.ws)
        prepared = run.committed("prepared").identity
        if not (run.ws.home / layout.PREPARED / layout.MANIFEST).is_file():
            host.fetch_prepared(run, prepared)

    def execute(self, host: Host, run: Run[S]) -> Outcome[R]:
        return self.collect(run, host.command(run, self.argv(run)))

    def argv(self, run: Run[S]) -> list[str]:
        raise NotImplementedError

    def collect(self, run: Run[S], events: Sequence[wire.Event]) -> Outcome[R]:
        raise NotImplementedError

    def evidence(self, run: Run[S]) -> dict[str, Path]:
        """The bundle paths a succeeded job contributes, each with the local file that holds it."""
        return {}


def _files(home: Path, folder: str) -> dict[str, Path]:
    return {f"{folder}/{p.name}": p for p in sorted((home / folder).iterdir()) if p.is_file()}


def _reference_home(plan: Plan, ws: Workspace) -> list[str]:
    """The ``--reference-home`` of a command that prepares a plan's inputs (none for the repository's replay)."""
    if plan.replay.source == "repository":
        return []
    if ws.reference_home is None:
        raise CoopError(
            f"plan {plan.name} reads {plan.replay.replay.path} and {plan.replay.retention.path} from a reference "
            "home, and this agent has none: start it with --reference-home DIR"
        )
    return ["--reference-home", str(ws.reference_home)]


class Canary(Handler[wire.CanarySpec, wire.CanaryResult]):
    """The canary of a draft (experiment.serving.canary): its own plan file and home beside the experiment's."""

    spec = wire.CanarySpec

    def stage(self, host: Host, run: Run[wire.CanarySpec]) -> None:
        plan = msgspec.toml.decode(run.spec.plan_toml.encode())
        link_replay_folder(plan, run.ws)
        canary_plan(run.ws).write_text(run.spec.plan_toml)

    def argv(self, run: Run[wire.CanarySpec]) -> list[str]:
        ws, path = run.ws, canary_plan(run.ws)
        plan = parse_plan(run.spec.plan_toml.encode(), "in the canary job's spec")
        argv = coop("canary", "--plan", path, "--home", ws.root / "canary", "--model-dir", ws.model_dir)
        return [*argv, *_reference_home(plan, ws)]

    def collect(self, run: Run[wire.CanarySpec], events: Sequence[wire.Event]) -> Outcome[wire.CanaryResult]:
        done = last_event(events, CanariedEvent)
        return Outcome(wire.CanaryResult(passed=done.passed, steps=done.steps))


def canary_plan(ws: Workspace) -> Path:
    return ws.root / "canary-plan.toml"


class Prepare(Handler[wire.PrepareSpec, wire.PrepareResult]):
    spec = wire.PrepareSpec

    def stage(self, host: Host, run: Run[wire.PrepareSpec]) -> None:
        run.ledger = {entry.kind: entry for entry in host.ledger(run)}
        write_plan(run.committed("plan"), run.ws)

    def argv(self, run: Run[wire.PrepareSpec]) -> list[str]:
        argv = coop("prepare", "--plan", run.ws.plan, "--home", run.ws.home, "--model-dir", run.ws.model_dir)
        return [*argv, *_reference_home(run.plan(), run.ws)]

    def collect(self, run: Run[wire.PrepareSpec], events: Sequence[wire.Event]) -> Outcome[wire.PrepareResult]:
        return Outcome(wire.PrepareResult(prepared_identity=last_event(events, PreparedEvent).prepared_identity))

    def evidence(self, run: Run[wire.PrepareSpec]) -> dict[str, Path]:
        # The seed's small files (tokenizer, template, config) let anyone re-tokenize; the weights stay here.
        seed = {
            f"{layout.SEED}/{name}": run.ws.model_dir / name
            for name in sorted(run.plan().seed.files)
            if not name.endswith(".safetensors")
        }
        return _files(run.ws.home, layout.PREPARED) | seed


class Train(Handler[wire.TrainSpec, wire.TrainResult]):
    spec = wire.TrainSpec

    def argv(self, run: Run[wire.TrainSpec]) -> list[str]:
        return coop("train", "--home", run.ws.home, "--model-dir", run.ws.model_dir, "--arm", run.arm)

    def collect(self, run: Run[wire.TrainSpec], events: Sequence[wire.Event]) -> Outcome[wire.TrainResult]:
        path = Path(last_event(events, CompletedEvent).result)
        written = msgspec.json.decode(path.read_bytes(), type=Result)
        model_dir = path.parent / "checkpoints" / written.candidate.checkpoint / "model"
        result = wire.TrainResult(
            step=written.candidate.step,
            model_identity=written.parameter_digest,
            receipt_sha256=written.candidate.receipt_sha256,
            final=True,  # `coop train` prints "completed" only after the plan's last update
            binding=written.binding,
            checkpoint_path=model_dir.relative_to(run.ws.home).as_posix(),
        )
        return Outcome(result, journal=written.journal, resource_samples=written.resource_samples)

    def evidence(self, run: Run[wire.TrainSpec]) -> dict[str, Path]:
        folder = layout.run(run.arm, run.job.rank)
        return {f"{folder}/{name}": run.ws.home / folder / name for name in layout.RUN_EVIDENCE}


class Evaluate(Handler[wire.EvaluateSpec, wire.EvaluateResult]):
    spec = wire.EvaluateSpec

    def stage(self, host: Host, run: Run[wire.EvaluateSpec]) -> None:
        super().stage(host, run)
        if run.job.role == "test":  # a test evaluation checks the checkpoint it is given against the selection
            evidence.write_selection(run.committed("selection"), run.ws.home)

    def argv(self, run: Run[wire.EvaluateSpec]) -> list[str]:
        role = run.job.role or "dev"
        ws = run.ws
        argv = coop("evaluate", "--home", ws.home, "--model-dir", ws.model_dir, "--arm", run.arm, "--role", role)
        if role == "test":
            argv += ["--selection", str(ws.home / layout.SELECTION)]
        return argv

    def collect(self, run: Run[wire.EvaluateSpec], events: Sequence[wire.Event]) -> Outcome[wire.EvaluateResult]:
        summary_path = Path(last_event(events, EvaluatedEvent).evaluation)
        lines = (summary_path.parent / "answers.jsonl").read_bytes().splitlines()
        answers = [msgspec.json.decode(line, type=wire.Answer) for line in lines if line.strip()]
        summary = msgspec.json.decode(summary_path.read_bytes(), type=Summary)
        return Outcome(wire.EvaluateResult(answers_sha256=summary.answers_sha256), answers=answers)

    def evidence(self, run: Run[wire.EvaluateSpec]) -> dict[str, Path]:
        return _files(run.ws.home, layout.evaluation(str(run.job.role), run.arm))


def _verify(run: Run[Any]) -> list[str]:
    return coop("checkpoint", "verify", "--home", run.ws.home, "--arm", run.arm, "--model-dir", run.ws.model_dir)


def _verified(events: Sequence[wire.Event]) -> wire.Candidate:
    """The checkpoint ``coop checkpoint verify`` verified."""
    candidate = last_event(events, VerifiedEvent).candidate
    if not candidate.is_checkpoint:
        raise CoopError("a verified candidate names its checkpoint's path, step, binding and receipt")
    return candidate


class Select(Handler[wire.SelectSpec, wire.SelectResult]):
    spec = wire.SelectSpec

    def argv(self, run: Run[wire.SelectSpec]) -> list[str]:
        return _verify(run)

    def collect(self, run: Run[wire.SelectSpec], events: Sequence[wire.Event]) -> Outcome[wire.SelectResult]:
        return Outcome(wire.SelectResult(candidate=_verified(events)))


def write_token(spec: wire.ServingSpec, ws: Workspace) -> None:
    """The probes' serving token, readable by this user only (the same token again is a no-op)."""
    token, path = spec.serving_token, serving_token_file(ws)
    if token is None or (path.exists() and path.read_text().strip() == token):
        return
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(token + "\n")


class ReplicaStart(Handler[wire.ReplicaStartSpec, wire.ReplicaStartResult]):
    """Serve this host's verified copy of the selected checkpoint behind a probe; both outlive the job."""

    spec = wire.ReplicaStartSpec

    def stage(self, host: Host, run: Run[wire.ReplicaStartSpec]) -> None:
        super().stage(host, run)
        write_token(run.spec, run.ws)
        # The probe checks the replica's answers against the arm's dev evaluation (maybe another host's).
        host.fetch_folder(run, layout.evaluation("dev", run.arm))

    def execute(self, host: Host, run: Run[wire.ReplicaStartSpec]) -> Outcome[wire.ReplicaStartResult]:
        verified = _verified(host.command(run, _verify(run)))
        selected = str(run.committed("selection").body["arms"][run.arm]["model_identity"])
        if verified.model_identity != selected:
            raise CoopError(f"this host's {run.arm} checkpoint is not the selected one; it is not served")
        ws, address = run.ws, host.advertise_address
        launch = Launch(
            key=str(run.job.experiment_id),
            coop=coop()[:3],
            model_dir=ws.home / verified.model_path,
            seed_dir=ws.model_dir,
            home=ws.home,
            reference=ws.home / layout.evaluation("dev", run.arm),
            model_identity=selected,
            numerics=run.plan().evaluation.numerics,
            device=run.plan().runtime.device,
            address=address,
            token_file=serving_token_file(ws),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            logs=ws.root / "logs" / f"replica-{run.job.attempt_id}",
            cwd=ROOT,
        )
        replica = host.services.start(launch, host.stopping)
        result = wire.ReplicaStartResult(
            model_identity=replica.model_identity,
            replica_url=replica.replica_url,
            probe_url=replica.probe_url,
            rank=run.spec.rank,
            identity={} if replica.identity is None else msgspec.to_builtins(replica.identity),
        )
        return Outcome(result)


class ReplicaStop(Handler[wire.ReplicaStopSpec, wire.ReplicaStopResult]):
    """Run by the agent itself: it stops the replica and probe it keeps (services.py)."""

    spec = wire.ReplicaStopSpec

    def stage(self, host: Host, run: Run[wire.ReplicaStopSpec]) -> None:
        """Nothing to read: the replica runs already."""

    def execute(self, host: Host, run: Run[wire.ReplicaStopSpec]) -> Outcome[wire.ReplicaStopResult]:
        return Outcome(wire.ReplicaStopResult(stopped=host.services.stop(str(run.job.experiment_id))))


class Benchmark(Handler[wire.BenchmarkSpec, wire.BenchmarkResult]):
    spec = wire.BenchmarkSpec

    def stage(self, host: Host, run: Run[wire.BenchmarkSpec]) -> None:
        super().stage(host, run)
        write_token(run.spec, run.ws)

    def argv(self, run: Run[wire.BenchmarkSpec]) -> list[str]:
        ws, phase = run.ws, run.spec.phase
        argv = coop("benchmark", "--phase", phase, "--home", ws.home, "--token-file", serving_token_file(ws))
        for endpoint in run.spec.endpoints:
            argv += ["--endpoint", endpoint]
        return [*argv, "--output", str(benchmark_output(run.job, phase, ws))]

    def collect(self, run: Run[wire.BenchmarkSpec], events: Sequence[wire.Event]) -> Outcome[wire.BenchmarkResult]:
        report = msgspec.json.decode(Path(last_event(events, BenchmarkedEvent).output).read_bytes())
        phase = wire.ServingPhase(phase=run.spec.phase, report=report)
        return Outcome(wire.BenchmarkResult(phase=phase.phase, metrics=report["metrics"]), serving=[phase])

    def evidence(self, run: Run[wire.BenchmarkSpec]) -> dict[str, Path]:
        return {layout.serving_phase(run.spec.phase): benchmark_output(run.job, run.spec.phase, run.ws)}


HANDLERS: dict[str, Handler[Any, Any]] = {
    "canary": Canary(),
    "prepare": Prepare(),
    "train": Train(),
    "evaluate": Evaluate(),
    "select": Select(),
    "replica-start": ReplicaStart(),
    "replica-stop": ReplicaStop(),
    "benchmark": Benchmark(),
}


def handler(kind: str) -> Handler[Any, Any]:
    found = HANDLERS.get(kind)
    if found is None:
        raise CoopError(f"this agent runs {', '.join(sorted(HANDLERS))} jobs, not {kind}")
    return found


@dataclass(frozen=True)
class PrivateLink:
    """The host's private link: the interface its gangs' collectives go over, and its address on it."""

    interface: str
    address: str

    def check(self) -> None:
        """Refuse an interface this host lacks, or an address that is not on it."""
        interfaces = psutil.net_if_addrs()
        if self.interface not in interfaces:
            raise CoopError(
                f"this host has no interface {self.interface!r} (it has {', '.join(sorted(interfaces))}); "
                "give --private-interface the private link's interface"
            )
        held = sorted(a.address.split("%")[0] for a in interfaces[self.interface] if a.family in _IP_FAMILIES)
        if self.address not in held:
            raise CoopError(
                f"address {self.address} is not on interface {self.interface} "
                f"(it holds {', '.join(held) or 'no IP address'}); give --private-address one of these"
            )

    def environment(self) -> dict[str, str]:
        """Every collective of a rank over this interface: gloo's on a CPU, NCCL's on a GPU (its bootstrap and
        its sockets alike)."""
        return {"GLOO_SOCKET_IFNAME": self.interface, "NCCL_SOCKET_IFNAME": self.interface}


_IP_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def environment(job: wire.Assignment, base: dict[str, str], private: PrivateLink | None = None) -> dict[str, str]:
    """The command's environment: the agent's, plus the rendezvous of a gang (torchrun's variables) and, on a host
    with a private link, the interface its collectives must use."""
    env = {**base, "RANK": str(job.rank), "WORLD_SIZE": str(job.world_size), "PYTHONUNBUFFERED": "1"}
    if job.master_addr is not None and job.master_port is not None:
        env["MASTER_ADDR"], env["MASTER_PORT"] = job.master_addr, str(job.master_port)
    if private is not None:
        env |= private.environment()
    return env


def _without_nulls(value: Any) -> Any:
    # TOML has no null; the plan's optional fields are absent in the file and None in its builtins.
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def link_replay_folder(plan: dict[str, Any], ws: Workspace) -> None:
    """A plan's replay folder, linked beside its plan file in the workspace to that folder of the agent's plans
    folder: checked again here, before anything is linked, to be a relative name that leads to a folder inside the
    plans folder (no absolute path, no '..', no link out of it), whatever the coordinator accepted."""
    ws.root.mkdir(parents=True, exist_ok=True)
    folder = plan.get("replay", {}).get("folder")
    if folder is None:
        return
    found = confined_problem(str(folder))
    if found is not None:
        raise CoopError(f"the plan's replay.folder {folder!r} {found}; this host links only folders of {ws.plans_dir}")
    plans = ws.plans_dir.resolve()
    target = (plans / folder).resolve()
    if not target.is_relative_to(plans):
        raise CoopError(f"the plan's replay.folder {folder!r} leads to {target}, outside {plans}; nothing was linked")
    link = ws.root / folder
    if not link.exists():
        link.symlink_to(target, target_is_directory=True)


def write_plan(committed: wire.LedgerEntry, ws: Workspace) -> Path:
    """The committed plan, from the experiment's ledger, as a TOML file beside the home (same identity)."""
    plan = committed.body["plan"]
    link_replay_folder(plan, ws)
    write_new_bytes(ws.plan, msgspec.toml.encode(_without_nulls(plan)))
    return ws.plan
