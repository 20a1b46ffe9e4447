"""What `make test`'s pytest run costs, test file by test file: wall seconds and CPU seconds, the tests' own and their
children's (bench/suite_accounting.py). Runs the suite as `make unit` does (two processes, whole files each) and
adds three totals: the run's wall time, the CPU of the whole process tree as the kernel accounts it when pytest is
reaped, and the machine's busy CPU over the run (/proc/stat, which also counts any process the tree left unreaped,
and anything else running). With ``--ci`` it runs `bash .ci/run` instead, on a clean clone (set-up, lint, types and
the same pytest run, the plugin passed in PYTEST_ADDOPTS): the totals are then CI's whole run's. Writes the run under
``--label`` into ``--output``, beside the runs already there.

    .venv/bin/python bench/test_suite_cpu.py --label after [-- EXTRA PYTEST ARGS]
    python3 CLONE/bench/test_suite_cpu.py --ci --label after-ci --output bench/results/test-suite-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "bench" / "results" / "test-suite-cpu.json"
# `make unit`'s command line (the Makefile), less --durations.
PYTEST = ["-m", "pytest", "tests/unit", "tests/integration", "tests/browser", "-q", "-n", "2", "--dist", "loadscope"]
PYTEST += ["--no-loadscope-reorder", "-p", "suite_accounting"]
TOP = 15


def busy_seconds() -> float:
    """The machine's CPU seconds spent not idle (all cores), from /proc/stat's first line."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    return done.stdout.strip() + ("+changes" if dirty.strip() else "")


def run(extra: list[str], ci: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="coop-suite-") as folder:
        env = {**os.environ, "COOP_SUITE_ACCOUNTING": folder}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bench"), env.get("PYTHONPATH")]))
        if ci:
            env["PYTEST_ADDOPTS"] = " ".join(filter(None, [env.get("PYTEST_ADDOPTS"), "-p suite_accounting"]))
        argv = ["bash", ".ci/run"] if ci else [sys.executable, *PYTEST, *extra]
        children_before = os.times().children_user + os.times().children_system
        busy_before, began = busy_seconds(), time.monotonic()
        done = subprocess.run(argv, cwd=ROOT, env=env, check=False)
        wall, busy = time.monotonic() - began, busy_seconds() - busy_before
        tree = os.times().children_user + os.times().children_system - children_before
        groups: dict[str, dict[str, float]] = {}
        for path in Path(folder).glob("*.json"):
            for name, group in json.loads(path.read_text()).items():
                total = groups.setdefault(name, dict.fromkeys(group, 0.0))
                for field, value in group.items():
                    total[field] += value
    modules = [
        {
            "module": name,
            "tests": int(g["tests"]),
            "wall_s": round(g["wall_s"], 1),
            "cpu_s": round(g["cpu_self_s"] + g["cpu_children_s"], 1),
            "cpu_self_s": round(g["cpu_self_s"], 1),
            "cpu_children_s": round(g["cpu_children_s"], 1),
        }
        for name, g in groups.items()
    ]
    modules.sort(key=lambda m: -m["cpu_s"])
    return {
        "command": " ".join(argv[:2] if ci else ["pytest", *PYTEST[2:], *extra]),
        "commit": commit(),
        "exit_code": done.returncode,
        "tests": sum(m["tests"] for m in modules),
        "wall_s": round(wall, 1),
        "cpu_tree_s": round(tree, 1),
        "cpu_machine_busy_s": round(busy, 1),
        "cpu_modules_s": round(sum(m["cpu_s"] for m in modules), 1),
        "top": [m["module"] for m in modules[:TOP]],
        "modules": modules,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="the run's name in the output, e.g. before or after")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--ci", action="store_true", help="run `bash .ci/run` (a clean clone) instead of pytest alone")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args()
    measured = run(args.pytest_args, args.ci)
    measured["machine"] = f"{os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}"
    results = json.loads(args.output.read_text()) if args.output.exists() else {"runs": {}}
    results["runs"][args.label] = measured
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in measured.items() if k != "modules"}, indent=2))
    for m in measured["modules"][:TOP]:
        print(f"{m['cpu_s']:8.1f} CPU-s {m['wall_s']:8.1f} s  {m['tests']:4d} tests  {m['module']}")
    sys.exit(measured["exit_code"])


if __name__ == "__main__":
    main()
