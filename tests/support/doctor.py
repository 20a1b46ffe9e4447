"""A host doctor's run (`coop-agent doctor`, `coop-server doctor`) as its tests read it."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT

FIX = "      fix: "


def run_doctor(program: str, argv: list[str], env: dict[str, str]) -> tuple[int, dict[str, str], str]:
    """``python -m PROGRAM doctor ARGV`` to its end: its exit code, check -> its line (a failure's fix line appended
    after a newline), and its output. A traceback fails the test at once."""
    done = subprocess.run(
        [sys.executable, "-m", program, "doctor", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in done.stderr, done.stderr
    lines: dict[str, str] = {}
    last = ""
    for line in done.stdout.splitlines():
        if line.startswith(FIX):
            lines[last] += "\n" + line.strip()
        else:
            last = line[6:].split(":")[0]
            lines[last] = line
    return done.returncode, lines, done.stdout
