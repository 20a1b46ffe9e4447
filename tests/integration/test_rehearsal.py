"""The runbook rehearsed on a booted host (scripts/rehearse.py --guard, root; `make rehearse` runs the whole
rehearsal, three hosts to the report, into bench/results/rehearsal-cpu.json): a Debian 12 container with systemd
as init, in a network namespace of its own, set up by docs/operating.md's own blocks (the user and folders, the
install from the locks through a read-only wheelhouse, the token and CA, the agent's unit), whose agent registers
over TLS with its unit's process running as coop; a token others can read stops the unit at its doctor until it
is made private; a power-off keeps the durable volume and empties the instance store; the deadline timer powers
the host off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow

STEPS = [
    "rootfs", "wheelhouse", "network", "coordinator", "boot host-a", "runbook: host-setup", "runbook: install-host",
    "runbook: agent-secrets", "stage the seed", "runbook: agent-unit", "a token others can read is refused at start",
    "a power-off keeps the durable volume and erases the instance store", "the deadline timer powers the host off",
]  # fmt: skip


def test_the_runbook_stands_up_a_booted_host_whose_agent_runs_as_coop(tmp_path: Path) -> None:
    out = tmp_path / "rehearsal.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "rehearse.py"), "--guard", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    verdict = json.loads(out.read_text())
    assert verdict["rehearsal"] == "guard" and verdict["passed"] and verdict["failed_step"] is None
    assert [step["name"] for step in verdict["steps"]] == STEPS
    assert all(step["passed"] for step in verdict["steps"])
    assert verdict["unit_users"] == {"host-a": "coop"}
    refused = next(step for step in verdict["steps"] if step["name"] == STEPS[10])
    assert "is open to users other than coop" in refused["detail"]
