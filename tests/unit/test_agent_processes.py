"""The agent's process groups, with real processes: a command dies with the agent, a restarted agent ends what a
group left running after its leader died (a command's children get no parent-death signal), in the group or in a
session of its own, and a recorded pid that now names another process is never signalled."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agent import jobs, processes
from agent.services import Launch, Services
from agent.spool import Group, Spool
from experiment.core.errors import CoopError
from tests.support import ROOT
from tests.support.waiting import wait_for


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def leftovers() -> Iterator[list[psutil.Process]]:
    """Processes a failing test must not leave running."""
    started: list[psutil.Process] = []
    yield started
    for process in started:
        with contextlib.suppress(psutil.Error):
            process.kill()  # psutil refuses a pid that now names another process


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[Spool]:
    opened = Spool(tmp_path / "spool.sqlite3")
    yield opened
    opened.close()


def test_a_command_dies_with_the_agent_that_started_it(tmp_path: Path, leftovers: list[psutil.Process]) -> None:
    stand_in = (
        "import subprocess, sys, time\n"
        "from pathlib import Path\n"
        "from agent import processes\n"
        "from agent.spool import Spool\n"
        "spool = Spool(Path(sys.argv[1]))\n"
        "command, _ = processes.start(\n"
        "    spool, 'a sleep', ['sleep', '300'], cwd=Path('.'), env={'PATH': '/usr/bin:/bin'},\n"
        "    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,\n"
        ")\n"
        "print(command.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", stand_in, str(tmp_path / "spool.sqlite3")], cwd=ROOT, stdout=subprocess.PIPE
    )
    try:
        assert agent.stdout is not None
        command = int(agent.stdout.readline())
        leftovers.append(psutil.Process(command))
        assert not _gone(command)
    finally:
        agent.kill()
        agent.wait(timeout=10)
    wait_for(lambda: _gone(command), 5.0, "the command to end with the agent")


def test_a_restart_ends_what_a_group_left_running_after_its_leader_died(
    tmp_path: Path, spool: Spool, leftovers: list[psutil.Process]
) -> None:
    leader, group = processes.start(
        spool,
        "a shell and its sleep",
        ["sh", "-c", "sleep 300 & echo $!; wait"],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert leader.stdout is not None
    child = int(leader.stdout.readline())
    leftovers.append(psutil.Process(child))
    leader.kill()  # as the parent-death signal would: the leader dies, its child lives on in the group
    leader.wait(timeout=10)
    time.sleep(0.2)
    assert not _gone(child) and os.getpgid(child) == group.pid

    restarted = Spool(spool.path)  # the agent's next run reads what its last run recorded
    try:
        assert restarted.groups() == [group]
        assert processes.end(restarted.groups(), 2.0) == [group]
    finally:
        restarted.close()
    assert _gone(child)
    assert processes.end([group], 2.0) == []  # nothing is left to end


def test_a_restart_ends_what_left_the_group_for_a_session_of_its_own(
    tmp_path: Path, spool: Spool, leftovers: list[psutil.Process]
) -> None:
    # As `coop replica` starts vLLM: in a session of its own, where no signal to the group reaches it.
    starter = (
        "import subprocess, sys, time\n"
        "server = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    leader, group = processes.start(
        spool,
        "a starter and its server",
        [sys.executable, "-c", starter],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert leader.stdout is not None
    server = int(leader.stdout.readline())
    leftovers.append(psutil.Process(server))
    leader.kill()
    leader.wait(timeout=10)
    assert not _gone(server) and os.getpgid(server) == server != group.pid

    assert processes.end(spool.groups(), 2.0) == [group]
    wait_for(lambda: _gone(server), 5.0, "the server in a session of its own to end")


def test_a_group_that_ignores_term_is_killed_after_the_grace(tmp_path: Path, spool: Spool) -> None:
    stubborn, group = processes.start(
        spool,
        "a shell that ignores TERM",
        ["sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.1; done"],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    began = time.monotonic()
    assert processes.end([group], 1.0) == [group]
    assert time.monotonic() - began >= 1.0
    assert stubborn.wait(timeout=10) == -signal.SIGKILL


def test_a_recorded_pid_that_names_a_later_process_is_never_signalled() -> None:
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        started = psutil.Process(other.pid).create_time()
        recycled = Group(other.pid, started - 3600.0, "0" * 32, "a command of an earlier boot")
        assert processes.end([recycled], 1.0) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait(timeout=10)


def test_a_spool_without_a_process_groups_table_opens_and_records_groups(tmp_path: Path) -> None:
    path = tmp_path / "spool.sqlite3"
    with sqlite3.connect(path) as db:  # uploads and attempts only: the spool adds the process_groups table
        db.executescript(
            "CREATE TABLE uploads (id INTEGER PRIMARY KEY AUTOINCREMENT, attempt_id TEXT NOT NULL, kind TEXT NOT NULL,"
            " key TEXT NOT NULL UNIQUE, body BLOB NOT NULL, state TEXT NOT NULL DEFAULT 'pending', note TEXT);"
            "CREATE TABLE attempts (attempt_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, lease_token TEXT NOT NULL,"
            " next_sequence INTEGER NOT NULL DEFAULT 0, finished INTEGER NOT NULL DEFAULT 0);"
        )
    db.close()
    spool = Spool(path)
    try:
        assert spool.groups() == []
        group = Group(12345, 1.5, "f" * 32, "a service")
        spool.record_group(group)
        assert spool.groups() == [group]
        spool.forget_group(group)
        assert spool.groups() == []
    finally:
        spool.close()


def test_a_replica_that_exits_at_start_fails_the_start_at_once_with_its_refusal(tmp_path: Path) -> None:
    """The replica is the real ``coop replica``, refusing for want of a vLLM interpreter; the probe beside it
    stays up (a sleeping stand-in), so only watching the replica ends the wait, long before its start-up limit."""
    commands = tmp_path / "commands.py"
    commands.write_text(
        "import runpy, sys, time\n"
        "if sys.argv[1] == 'probe':\n"
        "    time.sleep(600)\n"
        "sys.argv = ['coop', *sys.argv[1:]]\n"
        "runpy.run_module('experiment.cli', run_name='__main__')\n"
    )
    env = {**os.environ, "COOP_VLLM_PYTHON": str(tmp_path / "no-vllm" / "python")}
    (tmp_path / "token").write_text("t" * 32 + "\n")
    launch = Launch(
        key="experiment",
        coop=[sys.executable, str(commands)],
        model_dir=tmp_path,
        seed_dir=tmp_path,
        home=tmp_path,
        reference=tmp_path,
        model_identity="a" * 64,
        numerics="float32",
        device="cpu",
        address="127.0.0.1",
        token_file=tmp_path / "token",
        env=env,
        logs=tmp_path / "logs",
        cwd=ROOT,
        startup_seconds=60.0,
    )
    services = Services(grace=1.0, spool=Spool(tmp_path / "spool.sqlite3"))
    with pytest.raises(CoopError, match=r"the replica exited with 2 before the probe was healthy: coop: no vLLM"):
        services.start(launch, threading.Event())
    assert services.spool.groups() == []  # the probe was ended with it


@pytest.mark.parametrize(
    ("ending", "world_size", "outcome"),
    [
        ("os.abort()", 2, "lost"),  # an NCCL rank ended by its watchdog (SIGABRT): its gang is retried
        ("os.abort()", 1, "failed"),  # a single rank has no peer to lose: an abort is its own failure
        ("sys.exit(75)", 2, "lost"),  # a gloo rank that saw its gang's link break (EXIT_LINK)
        ("sys.exit(1)", 2, "failed"),
        ("os.kill(os.getpid(), signal.SIGKILL)", 2, "failed"),
    ],
)
def test_a_gang_rank_aborted_like_nccls_watchdog_ends_lost_and_other_endings_failed(
    ending: str, world_size: int, outcome: str
) -> None:
    process = subprocess.run([sys.executable, "-c", f"import os, signal, sys; {ending}"], check=False)
    assert jobs.failure_outcome(process.returncode, world_size) == outcome
