"""The agent's loop: register, heartbeat, claim, supervise one ``coop`` subprocess at a time, and report
through the spool (a sender thread drains it to the coordinator whenever the coordinator answers)."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import queue
import secrets
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import psutil

from agent import connection, evidence, jobs, processes
from agent.client import Coordinator, Rejected, Stopping, Unreachable, Untrusted, forever
from agent.services import Services
from agent.spool import BLOB_PREFIX, OpenAttempt, Spool, Upload
from experiment import wire
from experiment.core.errors import CoopError

log = logging.getLogger("coop.agent")

# What an earlier run of this agent left running is orphaned and its attempt is reported lost (and retried): its
# TERM need only release files and ports.
LEFTOVER_GRACE_SECONDS = 5.0


@dataclass(frozen=True)
class Settings:
    coordinator: str
    token: str
    name: str
    advertise_address: str
    work_dir: Path
    model_dir: Path
    plans_dir: Path
    reference_home: Path | None = None
    heartbeat_seconds: float = 10.0
    claim_wait_seconds: float = 20.0
    # Events are sent in batches: at most this many, at least this often while the command prints.
    batch_events: int = 500
    batch_seconds: float = 1.0
    # The grace period between TERM and KILL when the coordinator gives no deadline.
    grace_seconds: float = 30.0
    kinds: tuple[str, ...] = ()
    # The CA that signed an https coordinator's certificate (None: the system's CAs).
    ca_file: Path | None = None
    # The host's private link: the interface a gang's collectives use, and its address, where the gang meets.
    private: jobs.PrivateLink | None = None


def host_facts(name: str) -> dict[str, str]:
    """The labels registered with the coordinator: CPU count, memory and the GPUs ``gpu_facts`` finds."""
    return {
        "name": name,
        "cpu_count": str(os.cpu_count() or 0),
        "memory_bytes": str(psutil.virtual_memory().total),
        **gpu_facts(),
    }


def gpu_facts() -> dict[str, str]:
    """The GPUs nvidia-smi lists (none without it). Asked in nvidia-smi's own process: the agent never makes a
    CUDA context, which would hold memory on the card for as long as it runs, under its jobs' training and vLLM."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    query = [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    try:
        listed = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
        rows = [line.rsplit(",", 1) for line in listed.splitlines() if line.strip()]
        facts = {"gpu_count": str(len(rows))}
        for index, (gpu, mib) in enumerate(rows):
            facts[f"gpu{index}_name"] = gpu.strip()
            facts[f"gpu{index}_memory_bytes"] = str(int(mib) * 2**20)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("nvidia-smi did not list the GPUs (%s); registering none", exc)
        return {}
    return facts


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _without_nul(value: Any) -> Any:
    """``value`` with every NUL in its strings as U+FFFD: a Postgres text holds no NUL, so the coordinator
    refuses an event with one (a command may print it raw, or escaped in a JSON line)."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_without_nul(key): _without_nul(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_without_nul(item) for item in value]
    return value


def to_event(line: str) -> tuple[wire.Event, dict[str, object] | None]:
    """One stdout line as a coordinator event, and the decoded object when the line is a JSON object: the event's
    body, which the agent reads only as a command's final event (jobs.last_event)."""
    line = _without_nul(line)
    try:
        decoded = json.loads(line)
    except ValueError:
        decoded = None
    if isinstance(decoded, dict):
        decoded = _without_nul(decoded)
        return wire.Event(kind=str(decoded.get("event", "event"))[:100] or "event", body=decoded, at=_now()), decoded
    return wire.Event(kind="output", body={"line": line[:4000]}, at=_now()), None


@dataclass
class _Stop:
    reason: str
    deadline: float
    # cancelled: the coordinator asked (an operator's cancel, a halt), and the job ends. lost: the agent itself is
    # stopping (its unit restarted, its host shutting down), and the coordinator retries the job from its checkpoint.
    outcome: Literal["cancelled", "lost"]


class Agent:
    def __init__(self, settings: Settings, client: Coordinator, spool: Spool) -> None:
        self.settings = settings
        self.client = client
        self.spool = spool
        self.stopping = threading.Event()
        self._current: OpenAttempt | None = None
        self._stop: _Stop | None = None
        # The attempts this agent holds, from the reply of their claim until the coordinator has settled their
        # result (a spooled result may wait for it), and the key of the claim in flight, whose reply has not been
        # read. Every heartbeat names both: the coordinator ends as lost an active attempt of this agent it names
        # neither by id nor by claim key.
        self._held: set[uuid.UUID] = set()
        self._claiming: str | None = None
        self._lock = threading.Lock()
        # Held by a heartbeat from reading what it names until its reply: a claim takes it before it is sent, so
        # that no heartbeat read before the claim reaches the coordinator after it.
        self._beating = threading.Lock()
        self.services = Services(settings.grace_seconds, spool)
        # Set by whichever thread first finds that the coordinator's certificate does not verify; the agent stops.
        self.untrusted: Untrusted | None = None

    # The threads ----------------------------------------------------------------------------------

    def run(self) -> None:
        self._recover()
        with self._lock:
            self._held.update(self.spool.undelivered())
        sender = threading.Thread(target=self._send_loop, name="sender", daemon=True)
        sender.start()
        try:
            agent = forever(
                lambda: self.client.register(
                    wire.AgentRegister(
                        address=self.settings.advertise_address,
                        labels=host_facts(self.settings.name),
                        private_address=None if self.settings.private is None else self.settings.private.address,
                    )
                ),
                self.stopping,
            )
            log.info("registered as %s (%s)", agent.name, agent.id)
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
            self._claim_loop()
        except Stopping:
            pass
        except Untrusted as exc:
            self._distrust(exc)
        self.services.stop_all()
        if self.untrusted is not None:
            raise self.untrusted  # nothing more can be sent: the spool keeps what is pending for the next run
        self.drain(timeout=10.0)

    def _distrust(self, exc: Untrusted) -> None:
        """Stop the agent: a coordinator whose certificate does not verify gets nothing from it."""
        with self._lock:
            if self.untrusted is None:
                self.untrusted = exc
        self.stopping.set()

    def claimable(self) -> list[wire.JobKind]:
        """The kinds this agent claims now: its settings' (every kind by default), less the accelerator's kinds
        while a replica holds this host's GPU."""
        kinds = [kind for kind in wire.SPECS if not self.settings.kinds or kind in self.settings.kinds]
        if self.services.holds_replica():
            kinds = [kind for kind in kinds if kind not in wire.ACCELERATOR_KINDS]
        return kinds  # type: ignore[return-value]

    def _claim_loop(self) -> None:
        key: str | None = None
        while not self.stopping.is_set():
            kinds = self.claimable()
            if not kinds:
                self.stopping.wait(1.0)
                continue
            request = wire.ClaimRequest(wait_seconds=self.settings.claim_wait_seconds, kinds=kinds)
            if key is None:
                key = secrets.token_urlsafe(24)
                with self._beating, self._lock:
                    self._claiming = key
            try:
                reply = self.client.claim(msgspec.structs.replace(request, claim_key=key))
            except Unreachable as exc:
                # The coordinator may have leased an attempt and lost the reply: the same key gets it back.
                log.warning("claim: %s", exc)
                self.stopping.wait(1.0)
                continue
            assignment, key = reply.assignment, None
            with self._lock:
                if assignment is not None:
                    self._held.add(assignment.attempt_id)
                self._claiming = None
            if assignment is not None:
                self.supervise(assignment)

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.settings.heartbeat_seconds):
            try:
                self.heartbeat_once()
            except Untrusted as exc:
                self._distrust(exc)

    def heartbeat_once(self) -> None:
        with self._beating:
            with self._lock:
                request = wire.HeartbeatRequest(attempt_ids=sorted(self._held), claiming=self._claiming)
            try:
                reply = self.client.heartbeat(request, retries=0)
            except (Unreachable, Rejected) as exc:
                log.warning("heartbeat: %s", exc)
                return
        for directive in reply.directives:
            if directive.action == "stop":
                grace = self.settings.grace_seconds
                if directive.deadline is not None:
                    grace = max(0.0, (directive.deadline - _now()).total_seconds())
                with self._lock:
                    # The reply may be about an attempt that ended while it travelled: stop only the one named,
                    # if it is still the one running (a stop for the last job must not reach the next).
                    running = self._current
                    if self._stop is None and running is not None and directive.attempt_id == running.attempt_id:
                        self._stop = _Stop(
                            directive.reason or "stopped by the coordinator", time.monotonic() + grace, "cancelled"
                        )

    def _send_loop(self) -> None:
        while True:
            self.spool.changed.wait(1.0)
            self.spool.changed.clear()
            try:
                sent = self.send_pending()
            except Untrusted as exc:
                self._distrust(exc)
                return
            if not sent:
                time.sleep(1.0)

    def send_pending(self) -> bool:
        """Send every pending upload in spool order; False when the coordinator is unreachable."""
        while pending := self.spool.pending():
            for upload in pending:
                send, last_word = self._senders[upload.kind]
                try:
                    send(upload)
                except Unreachable as exc:
                    log.warning("upload %s deferred: %s", upload.key, exc)
                    return False
                except Rejected as exc:
                    # A refusal (the attempt ended, the lease is gone) does not change on replay: keep the row
                    # as rejected, for the record, and go on with the rest.
                    log.error("upload %s rejected: %s", upload.key, exc)
                    self.spool.settle(upload, "rejected", str(exc))
                else:
                    self.spool.settle(upload, "acknowledged")
                if last_word:  # the coordinator has the attempt's result, or refused it
                    self._release(upload.attempt_id)
        return True

    @property
    def _senders(self) -> dict[str, tuple[Callable[[Upload], object], bool]]:
        """Per spooled upload kind, how it is sent, and whether it is its attempt's last word (the result)."""
        client = self.client
        return {
            "events": (lambda upload: client.upload_events(upload.attempt_id, upload.key, upload.body), False),
            # Idempotent by content: a blob stored before is not stored again.
            "blob": (
                lambda upload: client.upload_blob(upload.attempt_id, upload.key.rsplit(BLOB_PREFIX, 1)[1], upload.body),
                False,
            ),
            "result": (lambda upload: client.upload_result(upload.attempt_id, upload.key, upload.body), True),
        }

    def _release(self, attempt_id: uuid.UUID) -> None:
        with self._lock:
            self._held.discard(attempt_id)

    def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.spool.pending(limit=1):
                return True
            self.spool.changed.set()
            time.sleep(0.1)
        return not self.spool.pending(limit=1)

    def _recover(self) -> None:
        """What an earlier run of this agent left: the process groups it started that still run are ended, and
        the attempts it had not finished are reported lost (the coordinator retries them)."""
        groups = self.spool.groups()
        ended = processes.end(groups, LEFTOVER_GRACE_SECONDS)
        for group in groups:
            if group in ended:
                log.warning("ended %s (process group %d), left running by the agent's last run", group.what, group.pid)
            self.spool.forget_group(group)
        commands = {group.attempt_id: group for group in groups if group.attempt_id is not None}
        for attempt in self.spool.unfinished():
            reason = "the agent restarted while the command ran"
            command = commands.get(attempt.attempt_id)
            if command is not None and command in ended:
                reason += f"; its command (pid {command.pid}) was ended"
            elif command is not None:
                reason += f"; its command (pid {command.pid}) had ended with the agent"
            log.warning(
                "attempt %s was running when the agent stopped; reporting it lost: %s", attempt.attempt_id, reason
            )
            result = wire.AttemptResult(lease_token=attempt.lease_token, outcome="lost", reason=reason)
            self.spool.add_result(attempt, result)

    # One job ----------------------------------------------------------------------------------------

    def workspace(self, experiment_id: object) -> jobs.Workspace:
        return jobs.Workspace(
            root=self.settings.work_dir / "experiments" / str(experiment_id),
            model_dir=self.settings.model_dir,
            plans_dir=self.settings.plans_dir,
            reference_home=self.settings.reference_home,
        )

    def supervise(self, job: wire.Assignment) -> None:
        log.info("claimed %s job %s (attempt %s, rank %d)", job.kind, job.job_id, job.attempt_id, job.rank)
        attempt = OpenAttempt(job.attempt_id, job.job_id, job.lease_token)
        try:
            forever(lambda: self.client.start(job.attempt_id, job.lease_token), self.stopping)
        except Rejected as exc:
            log.error("start of attempt %s refused: %s", job.attempt_id, exc)
            self._release(job.attempt_id)
            return
        except Stopping:
            return
        self.spool.open_attempt(job.attempt_id, job.job_id, job.lease_token)
        with self._lock:
            self._current, self._stop = attempt, None
        blobs: dict[str, bytes] = {}
        try:
            result, blobs = self._run(job)
        except jobs.CommandEnded as ended:
            result = wire.AttemptResult(
                lease_token=job.lease_token, outcome=ended.outcome, exit_code=ended.exit_code, reason=ended.reason
            )
        except (CoopError, OSError, msgspec.ValidationError) as exc:
            result = wire.AttemptResult(lease_token=job.lease_token, outcome="failed", reason=str(exc)[:4000])
        finally:
            with self._lock:
                self._current, self._stop = None, None
        self.spool.add_result(attempt, result, blobs)
        log.info("attempt %s %s", job.attempt_id, result.outcome)

    def _run(self, job: wire.Assignment) -> tuple[wire.AttemptResult, dict[str, bytes]]:
        """The attempt's result, and the evidence blobs it names (the spool uploads them before the result)."""
        handler = jobs.handler(job.kind)
        run = jobs.Run(job, handler.read_spec(job), self.workspace(job.experiment_id))
        handler.stage(self, run)
        outcome = handler.execute(self, run)
        named, blobs = evidence.as_blobs(handler.evidence(run))
        result = wire.AttemptResult(
            lease_token=job.lease_token,
            outcome="succeeded",
            exit_code=0,
            result=wire.untagged(outcome.result),
            journal=outcome.journal,
            resource_samples=outcome.resource_samples,
            answers=outcome.answers,
            serving=outcome.serving,
            evidence=named,
        )
        return result, blobs

    # What a job's handler asks of the agent (jobs.Host) ------------------------------------------------

    @property
    def advertise_address(self) -> str:
        return self.settings.advertise_address

    def ledger(self, run: jobs.Run[Any]) -> list[wire.LedgerEntry]:
        return forever(lambda: self.client.ledger(run.job.experiment_id), self.stopping)

    def fetch_prepared(self, run: jobs.Run[Any], prepared_identity: str) -> None:
        log.info("fetching the prepared inputs %s from the coordinator", prepared_identity[:16])
        experiment_id, home = run.job.experiment_id, run.ws.home
        forever(lambda: evidence.fetch_prepared(self.client, experiment_id, home, prepared_identity), self.stopping)

    def fetch_folder(self, run: jobs.Run[Any], folder: str) -> None:
        experiment_id, home = run.job.experiment_id, run.ws.home
        forever(lambda: evidence.fetch_folder(self.client, experiment_id, home, folder), self.stopping)

    def command(self, run: jobs.Run[Any], argv: list[str]) -> list[wire.Event]:
        """Run the job's command in a process group of its own, its stdout spooled as events; returns the events of
        its JSON lines, and raises jobs.CommandEnded when it was stopped or exited non-zero."""
        job = run.job
        logs = run.ws.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        stderr_path = logs / f"{job.kind}-{job.attempt_id}.stderr"
        with stderr_path.open("wb") as stderr:
            process, group = processes.start(
                self.spool,
                f"`coop {job.kind}` of attempt {job.attempt_id}",
                argv,
                cwd=jobs.ROOT,
                env=jobs.environment(job, dict(os.environ), self.settings.private),
                stdout=subprocess.PIPE,
                stderr=stderr,
                attempt_id=job.attempt_id,
            )
            try:
                decoded, stopped = self._forward(process, OpenAttempt(job.attempt_id, job.job_id, job.lease_token))
            finally:
                # The group ends with its command: what the command left running (or the command itself, when
                # forwarding failed) would otherwise hold its files, ports and GPUs.
                processes.end([group], self.settings.grace_seconds)
                self.spool.forget_group(group)
        code = process.returncode
        if stopped is not None:
            raise jobs.CommandEnded(stopped.outcome, code, stopped.reason)
        if code != 0:
            tail = stderr_path.read_text(errors="replace")[-3000:]
            outcome = jobs.failure_outcome(code, job.world_size)
            raise jobs.CommandEnded(outcome, code, f"`coop {job.kind}` exited with {code}: {tail}")
        return decoded

    def _forward(self, process: subprocess.Popen[bytes], attempt: OpenAttempt) -> tuple[list[wire.Event], _Stop | None]:
        """Spool the command's stdout as event batches until it exits; stop it when asked to."""
        lines: queue.Queue[bytes | None] = queue.Queue()

        def read() -> None:
            assert process.stdout is not None
            for raw in process.stdout:
                lines.put(raw)
            lines.put(None)

        threading.Thread(target=read, name="stdout", daemon=True).start()
        decoded: list[wire.Event] = []
        batch = _Batch(self.spool, attempt, self.settings.batch_events, self.settings.batch_seconds)
        signals = _Signals(process)
        done = False
        while not done:
            try:
                raw = lines.get(timeout=0.1)
            except queue.Empty:
                raw = b""
            done = raw is None
            if raw is not None and raw.strip():
                event, body = to_event(raw.decode(errors="replace").rstrip("\n"))
                if body is not None:
                    decoded.append(event)
                batch.add(event)
            batch.send_if_due(done)
            if not done:
                signals.send(self._stop_wanted())
        process.wait()
        return decoded, signals.stop

    def _stop_wanted(self) -> _Stop | None:
        """The stop the coordinator or the agent's shutdown asked for, if any."""
        with self._lock:
            if self.stopping.is_set() and self._stop is None:
                deadline = time.monotonic() + self.settings.grace_seconds
                self._stop = _Stop(
                    "the agent is shutting down (its unit stopped or its host powering off)", deadline, "lost"
                )
            return self._stop


class _Batch:
    """Events waiting to be spooled: at most ``size`` of them, none older than ``seconds``."""

    def __init__(self, spool: Spool, attempt: OpenAttempt, size: int, seconds: float) -> None:
        self.spool, self.attempt, self.size, self.seconds = spool, attempt, size, seconds
        self.events: list[wire.Event] = []
        self.first = 0.0

    def add(self, event: wire.Event) -> None:
        if not self.events:
            self.first = time.monotonic()
        self.events.append(event)

    def send_if_due(self, done: bool) -> None:
        due = done or len(self.events) >= self.size or time.monotonic() - self.first >= self.seconds
        if self.events and due:
            self.spool.add_events(self.attempt, self.events)
            self.events = []


class _Signals:
    """A stopped command gets TERM at once and KILL once the stop's deadline passed."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.stop: _Stop | None = None
        self.terminated = self.killed = False

    def send(self, stop: _Stop | None) -> None:
        if stop is None:
            return
        self.stop = stop
        if not self.terminated:
            _signal(self.process, signal.SIGTERM)
            self.terminated = True
        elif not self.killed and time.monotonic() >= stop.deadline and self.process.poll() is None:
            _signal(self.process, signal.SIGKILL)
            self.killed = True


def _signal(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def run(settings: Settings) -> None:
    """Run the agent until SIGTERM or SIGINT; a CoopError when the coordinator may not, or did not, get its token,
    or when the private link is not this host's."""
    if settings.private is not None:
        settings.private.check()
    verify = connection.tls_context(settings.coordinator, settings.ca_file)
    client = Coordinator(settings.coordinator, settings.token, verify=True if verify is None else verify)
    spool = Spool(settings.work_dir / "spool.sqlite3")
    agent = Agent(settings, client, spool)

    def stop(signum: int, frame: object) -> None:
        log.info("signal %d: stopping", signum)
        agent.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        agent.run()
    finally:
        client.close()
        spool.close()
