"""The process groups the agent starts (job commands, replicas and probes): each leader dies with the agent (a
parent-death signal), and each group is recorded in the spool until it has ended, so that an agent that restarts
ends what its earlier run left running. A command's own children get no parent-death signal, and some leave the
group (``coop replica`` starts vLLM in a session of its own): a group's processes are those of its process group
and those whose environment carries its marker, which every descendant inherits."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import psutil

from agent.spool import Group, Spool

MARKER = "COOP_AGENT_GROUP"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
# The leader's create time as recorded and as read again may differ by a clock adjustment; a pid is handed out
# again only after the kernel has gone through every other pid, which takes far longer than this.
_SAME_START_SECONDS = 1.0
# After KILL, how long to wait for the processes to be gone (and their GPUs and ports free).
_KILLED_SECONDS = 5.0


def _dies_with(parent: int) -> Callable[[], None] | None:
    """The child's last step before exec: a SIGKILL when the agent dies. The signal follows the thread that
    forked the child; the agent forks from its main thread, which lives as long as the agent."""
    libc = _LIBC
    if libc is None:
        return None

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the agent died before the signal was armed
            os._exit(1)

    return arm


def start(
    spool: Spool,
    what: str,
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    stdout: int | IO[bytes],
    stderr: int | IO[bytes],
    attempt_id: uuid.UUID | None = None,
) -> tuple[subprocess.Popen[bytes], Group]:
    """Start ``argv`` as the leader of its own process group (TERM and KILL reach every child it starts) and
    record the group in the spool; ``what`` names it in the log."""
    marker = secrets.token_hex(16)
    process = subprocess.Popen(
        argv,
        cwd=cwd,
        env={**env, MARKER: marker},
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=_dies_with(os.getpid()),
    )
    group = Group(process.pid, psutil.Process(process.pid).create_time(), marker, what, attempt_id)
    spool.record_group(group)
    return process, group


def _members(group: Group) -> list[psutil.Process]:
    """The group's live processes. Its process group is gone when the leader's pid names a later process: a pid
    is not handed out again while a process group of that id has members."""
    try:
        leader = psutil.Process(group.pid)
        ours = abs(leader.create_time() - group.started) <= _SAME_START_SECONDS
    except psutil.NoSuchProcess:
        ours = True  # the leader is gone; what it started may not be
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if process.pid == os.getpid() or not _alive(process):
                continue
            if (ours and _in_group(process, group)) or process.environ().get(MARKER) == group.marker:
                members.append(process)
    return members


def _alive(process: psutil.Process) -> bool:
    """Running, and not a zombie (a dead child its parent has not reaped yet holds nothing)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _in_group(process: psutil.Process, group: Group) -> bool:
    try:
        return os.getpgid(process.pid) == group.pid
    except OSError:
        return False


def _signal(groups: Mapping[Group, Sequence[psutil.Process]], sig: signal.Signals) -> None:
    """``sig`` to each group. A TERM goes to the process group while it has a live process, whose commands stop
    what they started themselves (``coop replica`` drains its vLLM before it stops it); to the processes that
    left the group only once none is left. A KILL goes to every process."""
    for group, members in groups.items():
        inside = any(_in_group(process, group) for process in members)
        if inside:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group.pid, sig)
        if sig == signal.SIGKILL or not inside:
            for process in members:
                with contextlib.suppress(psutil.Error):
                    process.send_signal(sig)  # psutil refuses a pid that now names another process


def _wait(groups: Mapping[Group, Sequence[psutil.Process]], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    members = [process for processes in groups.values() for process in processes]
    while any(_alive(process) for process in members) and time.monotonic() < deadline:
        time.sleep(0.05)


def end(groups: Sequence[Group], grace: float) -> list[Group]:
    """End every one of ``groups`` that still has a live process: TERM, up to ``grace`` seconds, then KILL.
    Returns the groups that had one."""
    running = {group: members for group in groups if (members := _members(group))}
    _signal(running, signal.SIGTERM)
    _wait(running, grace)
    left = {group: members for group in running if (members := _members(group))}
    _signal(left, signal.SIGKILL)
    _wait(left, _KILLED_SECONDS)
    return list(running)
