"""One job at a time: its attempt started, its handler run (agent/jobs.py), its ``coop`` command in a process
group of its own with stdout spooled as events, a stop the coordinator or the agent's shutdown asks for, and its
result spooled. The supervisor is what a job's handler asks of the agent (jobs.Host)."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from agent import evidence, jobs, processes
from agent.client import Coordinator, Rejected, Stopping, forever
from agent.leases import Leases
from agent.services import Services
from agent.settings import Settings
from agent.spool import OpenAttempt, Spool
from experiment import wire
from experiment.core.errors import CoopError

log = logging.getLogger("coop.agent")

# What an earlier run of this agent left running is orphaned and its attempt is reported lost (and retried): its
# TERM need only release files and ports.
LEFTOVER_GRACE_SECONDS = 5.0


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


SHUTDOWN_REASON = "the agent is shutting down (its unit stopped or its host powering off)"


@dataclass
class _Stop:
    reason: str
    deadline: float
    # cancelled: the coordinator asked (an operator's cancel, a halt), and the job ends. lost: the agent itself is
    # stopping (its unit restarted, its host shutting down), and the coordinator retries the job from its checkpoint.
    outcome: Literal["cancelled", "lost"]


class Supervisor:
    """The job running now, if any, and the stop asked of it (one lock)."""

    def __init__(
        self,
        settings: Settings,
        client: Coordinator,
        spool: Spool,
        leases: Leases,
        stopping: threading.Event,
    ) -> None:
        self.settings, self.client, self.spool, self.leases = settings, client, spool, leases
        self.stopping = stopping
        self.services = Services(settings.grace_seconds, spool)
        self._current: OpenAttempt | None = None
        self._stop: _Stop | None = None
        self._lock = threading.Lock()

    def stop_attempt(self, attempt_id: object, reason: str, grace: float) -> None:
        """The coordinator's stop of an attempt. The heartbeat's reply may be about an attempt that ended while it
        travelled: only the one named is stopped, if it is still the one running (a stop for the last job must not
        reach the next)."""
        with self._lock:
            running = self._current
            if self._stop is None and running is not None and attempt_id == running.attempt_id:
                self._stop = _Stop(reason, time.monotonic() + grace, "cancelled")

    def recover(self) -> None:
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
            self.leases.release(job.attempt_id)
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
        except Stopping:  # the shutdown came while the job was staged, before its command started
            result = wire.AttemptResult(lease_token=job.lease_token, outcome="lost", reason=SHUTDOWN_REASON)
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
                self._stop = _Stop(SHUTDOWN_REASON, deadline, "lost")
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
