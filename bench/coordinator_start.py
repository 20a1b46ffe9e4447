"""What a coordinator's start costs: `coop-server serve --migrate` on a new SQLite home, from its process's start to
its first answer of ``GET /health``. The server process's CPU (user + system, psutil) and its resident memory at
that answer, and the wall time, over ``--starts`` starts; with ``--baseline REV`` the server of commit REV too (a git
worktree, the same virtual environment), the two started in turn. A restarted coordinator pays this before it
answers its agents again. Prints one JSON object and writes it to ``--output``.

    .venv/bin/python bench/coordinator_start.py [--baseline REV] [--starts 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from coordinator import ROOT, _commit, _free_port, _sources


def start_once(source: Path) -> dict[str, float]:
    """One start of the server of ``source``: its CPU seconds, resident MiB and wall seconds at its first answer."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="coop-bench-start-") as home:
        env = {**os.environ, "COOP_HOME": home}
        began = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--port", str(port), "--migrate"],
            env=env,
            cwd=source,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            server = psutil.Process(process.pid)
            with httpx.Client(timeout=1) as client:
                while True:
                    try:
                        if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if process.poll() is not None:
                        raise RuntimeError(f"the server of {source} exited with {process.returncode}")
                    time.sleep(0.02)
            wall = time.perf_counter() - began
            cpu = server.cpu_times()
            rss = server.memory_info().rss
        finally:
            process.terminate()
            process.wait(timeout=30)
    return {"cpu_s": cpu.user + cpu.system, "rss_mib": rss / 2**20, "wall_s": wall}


def summary(starts: list[dict[str, float]]) -> dict[str, Any]:
    figures: dict[str, Any] = {"starts": len(starts)}
    for name in ("cpu_s", "rss_mib", "wall_s"):
        values = [start[name] for start in starts]
        figures[name] = {
            "median": round(statistics.median(values), 3),
            "min": round(min(values), 3),
            "max": round(max(values), 3),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="also start the server of this git revision, in turn with this code's")
    parser.add_argument("--starts", type=int, default=10, help="starts of each server")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "coordinator-start-cpu.json")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        sources = _sources(stack, args.baseline)
        measured: dict[str, list[dict[str, float]]] = {label: [] for label in sources}
        for source in sources.values():
            start_once(source)  # warm-up: the file cache, the bytecode
        for turn in range(args.starts):
            for label in list(sources)[:: 1 if turn % 2 == 0 else -1]:
                measured[label].append(start_once(sources[label]))
        results = {label: {"commit": _commit(sources[label]), **summary(measured[label])} for label in sources}
    report = {"bench": "coordinator_start", "cpus": os.cpu_count(), "database": "sqlite", "results": results}
    text = json.dumps(report, indent=2)
    args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
