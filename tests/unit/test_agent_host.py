"""What an agent registers of its host, and that it never makes a CUDA context of its own."""

from __future__ import annotations

import datetime
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from agent import loop
from agent.jobs import PrivateLink, environment
from experiment import wire
from experiment.core.errors import CoopError
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


def test_a_private_link_must_be_an_interface_of_this_host_holding_its_address() -> None:
    """Checked against the host's real interfaces (loopback is on every host)."""
    PrivateLink("lo", "127.0.0.1").check()
    with pytest.raises(CoopError, match=r"this host has no interface 'priv9'"):
        PrivateLink("priv9", "127.0.0.1").check()
    with pytest.raises(CoopError, match=r"address 198\.18\.2\.1 is not on interface lo \(it holds .*127\.0\.0\.1"):
        PrivateLink("lo", "198.18.2.1").check()


def test_a_rank_on_a_host_with_a_private_link_pins_its_collectives_to_it() -> None:
    job = wire.Assignment(
        job_id=uuid.uuid4(),
        attempt_id=uuid.uuid4(),
        experiment_id=uuid.uuid4(),
        kind="train",
        arm="clean-pair",
        role=None,
        spec={},
        number=1,
        rank=1,
        world_size=2,
        master_addr="198.18.2.1",
        master_port=29501,
        lease_token="t",
        lease_expires_at=datetime.datetime.now(datetime.UTC),
    )
    env = environment(job, {"PATH": "/bin"}, PrivateLink("priv0", "198.18.2.2"))
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "priv0"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"]) == ("198.18.2.1", "29501", "1")
    assert "GLOO_SOCKET_IFNAME" not in environment(job, {"PATH": "/bin"})
