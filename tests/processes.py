"""Real processes: a coordinator (`coop-server serve`), and ranks with the torchrun environment for the training
and evaluation tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def launch(args: list[str], world: int) -> list[subprocess.CompletedProcess[str]]:
    """Start ``world`` real processes of ``args``, one per rank; wait for all."""
    port = free_port()
    processes = [
        subprocess.Popen(
            args, env=rank_env(rank, world, port), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for rank in range(world)
    ]
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=300)
            results.append(subprocess.CompletedProcess(args, process.returncode, out, err))
    finally:  # a rank that hangs is killed with its peers, never left behind
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def coop_train(home: Path, seed: Path, arm: str, world: int, *extra: str) -> list[subprocess.CompletedProcess[str]]:
    args = [
        sys.executable,
        "-m",
        "experiment.cli",
        "train",
        "--home",
        str(home),
        "--model-dir",
        str(seed),
        "--arm",
        arm,
        *extra,
    ]
    return launch(args, world)


@contextmanager
def served(database_url: str, home: Path, **environment: str) -> Iterator[str]:
    """`coop-server serve` on a free loopback port (``environment``: COOP_* settings), until the block ends."""
    port = free_port()
    env = {**os.environ, "COOP_HOME": str(home), "COOP_DATABASE_URL": database_url, **environment}
    log = (home / "server.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/schema/openapi.json", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start: {(home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()
