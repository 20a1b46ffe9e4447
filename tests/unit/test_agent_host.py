"""What an agent registers of its host, and that it never makes a CUDA context of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent import loop
from tests.support import ROOT


def test_an_agent_registers_its_host_without_loading_torch() -> None:
    """torch is never imported by the agent, so it cannot make a CUDA context on a card its jobs need."""
    code = "import sys, agent.cli, agent.loop; facts = agent.loop.host_facts('h'); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "False"


def test_gpu_facts_come_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi's own CSV (two cards, one name with a comma), read as the coordinator's labels; none without it.
    The program here stands in for nvidia-smi, which this host lacks, printing what its query prints."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert loop.gpu_facts() == {}
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf 'NVIDIA L40S, 46068\\nNVIDIA L40S, rev 2, 46068\\n'\n")
    smi.chmod(0o755)
    assert loop.gpu_facts() == {
        "gpu_count": "2",
        "gpu0_name": "NVIDIA L40S",
        "gpu0_memory_bytes": str(46068 * 2**20),
        "gpu1_name": "NVIDIA L40S, rev 2",
        "gpu1_memory_bytes": str(46068 * 2**20),
    }
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert loop.gpu_facts() == {}
