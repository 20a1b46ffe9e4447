"""`coop-agent doctor`, the GPU host's preflight, as a real process against a real coordinator over TLS: on a host
that has what the run needs, every check passes; each thing missing or wrong fails its own check, with its fix, exit 2
and nothing changed. The GPU is a fake `nvidia-smi` (a script that prints what a g6e's prints); every other check
reads the real thing: files and their owners, the mounts table, `ip`, the compiler, the coordinator's answer and its
Date header."""

from __future__ import annotations

import http.server
import os
import shutil
import threading
import time
from collections.abc import Iterator
from email.utils import formatdate
from pathlib import Path

import pytest

from experiment.seed import seedfiles
from tests.conftest import write_plan
from tests.support import ROOT
from tests.support.doctor import run_doctor
from tests.support.processes import QUICK, CoordinatorProcess
from tests.support.tls import Authority, ServerFiles

# A g6e.xlarge's L40S as nvidia-smi --query-gpu=name,driver_version,memory.free --format=csv,noheader,nounits prints it.
L40S = "NVIDIA L40S, 580.65.06, 45403"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> ServerFiles:
    return Authority("coop test CA").issue(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory, certificate: ServerFiles) -> Iterator[CoordinatorProcess]:
    server = CoordinatorProcess(tmp_path_factory.mktemp("coordinator"), certificate=certificate, **QUICK)
    server.start()
    try:
        yield server
    finally:
        server.close()


def _fake_bin(folder: Path, gpu: str | None = L40S, compiler: bool = True) -> Path:
    """A PATH of its own: `ip`, `ldd`, a C compiler unless told otherwise, and an nvidia-smi that prints ``gpu``."""
    folder.mkdir(parents=True, exist_ok=True)
    for tool in ("ip", "ldd", *(["cc"] if compiler else [])):
        found = shutil.which(tool)
        assert found is not None, f"{tool} is not installed"
        (folder / tool).symlink_to(found)
    if gpu is not None:
        smi = folder / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho '{gpu}'\n")
        smi.chmod(0o755)
    return folder


class Host:
    """A host's files as the runbook leaves them: a private token, a work folder, the seed."""

    def __init__(self, folder: Path, coordinator: CoordinatorProcess, certificate: ServerFiles) -> None:
        self.folder = folder
        self.token = folder / "agent-token"
        self.token.touch(mode=0o600)
        self.token.write_text("coop_doctor-token\n")
        self.home = folder / "home"
        self.home.mkdir()
        self.bin = _fake_bin(folder / "bin")
        self.plan = write_plan(folder / "plan.toml", seedfiles.snapshot_of(ROOT / "seeds" / "tiny"))
        self.flags: dict[str, str | None] = {
            "--coordinator": coordinator.url, "--ca-file": str(certificate.ca_file), "--token-file": str(self.token),
            "--work-dir": str(folder / "work"), "--model-dir": str(ROOT / "seeds" / "tiny"),
            "--private-interface": "lo", "--private-address": "127.0.0.1", "--plan": str(self.plan),
            "--device": "cuda",
        }  # fmt: skip

    def doctor(
        self, flags: dict[str, str | None] | None = None, extra: tuple[str, ...] = (), **environment: str
    ) -> tuple[int, dict[str, str], str]:
        """Exit code, check -> its line (a failure's fix appended), and the output; ``flags`` change the host's
        (None leaves one out)."""
        given = {**self.flags, **(flags or {})}
        argv = [part for flag, value in given.items() if value is not None for part in (flag, value)]
        env = {"PATH": str(self.bin), "HOME": str(self.home), "LANG": "C.UTF-8", **environment}
        return run_doctor("agent", [*argv, *extra], env)


@pytest.fixture
def host(tmp_path: Path, coordinator: CoordinatorProcess, certificate: ServerFiles) -> Host:
    return Host(tmp_path, coordinator, certificate)


def test_a_host_with_what_the_run_needs_passes_every_check(host: Host) -> None:
    code, lines, out = host.doctor()
    assert code == 0, out
    assert list(lines) == [
        "python", "venv .venv", "venv .venv-vllm", "vllm libraries", "home", "token file", "storage", "compiler",
        "driver", "gpu memory", "disk", "private link", "coordinator", "clock", "seed",
    ], out  # fmt: skip
    assert all(line.startswith("ok    ") for line in lines.values()), out
    assert "NVIDIA L40S driver 580.65.06" in lines["driver"]
    assert "over TLS" in lines["coordinator"]


@pytest.mark.parametrize(
    ("case", "check", "detail", "fix"),
    [
        ("token open to others", "token file", "is open to users other than", "chmod 600"),
        ("old driver", "driver", "driver 550.54.15; the CUDA 13 wheels need 580 or later", "install NVIDIA's driver"),
        ("busy GPU", "gpu memory", "0.0 GiB free; a rank of the 2-rank pair needs", "stop what holds the GPU"),
        ("no compiler", "compiler", "no C compiler (cc, gcc) on PATH", "apt-get install gcc python3.11-dev"),
        ("no nvidia-smi", "driver", "nvidia-smi is not on PATH", "install NVIDIA's driver"),
        ("HOME not writable", "home", "is not a folder this user can write", "useradd --create-home"),
        ("work folder on an erased mount", "storage", "which a stop of this host erases", "durable (EBS) volume"),
        ("another interface", "private link", "lo holds", "give lo the address 192.0.2.7"),
        ("NCCL told another interface", "private link", "NCCL_SOCKET_IFNAME=eth9 names another", "remove"),
        ("another CA", "coordinator", "CERTIFICATE_VERIFY_FAILED", "CA file signed its certificate"),
        ("a changed seed", "seed", "config.json", "stage the seed again"),
    ],
)
def test_each_thing_wrong_fails_its_check_with_its_fix_and_exit_2(
    host: Host, tmp_path: Path, case: str, check: str, detail: str, fix: str
) -> None:
    flags: dict[str, str | None] = {}
    extra: tuple[str, ...] = ()
    environment: dict[str, str] = {}
    if case == "token open to others":
        host.token.chmod(0o640)
    elif case == "old driver":
        (host.bin / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA L40S, 550.54.15, 45403'\n")
    elif case == "busy GPU":
        (host.bin / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA L40S, 580.65.06, 0'\n")
    elif case == "no compiler":
        shutil.rmtree(host.bin)
        host.bin = _fake_bin(host.bin, compiler=False)
    elif case == "no nvidia-smi":
        (host.bin / "nvidia-smi").unlink()
    elif case == "HOME not writable":
        environment["HOME"] = str(tmp_path / "absent")
    elif case == "work folder on an erased mount":
        flags["--work-dir"] = f"/dev/shm/coop-doctor-{os.getpid()}"
        extra = ("--ephemeral-mount", "/dev/shm")
    elif case == "another interface":
        flags["--private-address"] = "192.0.2.7"
    elif case == "NCCL told another interface":
        environment["NCCL_SOCKET_IFNAME"] = "eth9"
    elif case == "another CA":
        flags["--ca-file"] = str(Authority("another CA").write_ca(tmp_path / "other-ca.pem"))
    elif case == "a changed seed":
        seed = tmp_path / "seed"
        shutil.copytree(ROOT / "seeds" / "tiny", seed)
        with (seed / "config.json").open("a") as handle:
            handle.write(" ")
        flags["--model-dir"] = str(seed)
    before = {path: (path.stat().st_mode, path.read_bytes()) for path in host.folder.rglob("*") if path.is_file()}
    code, lines, out = host.doctor(flags, extra, **environment)
    assert code == 2, out
    failing = [name for name, line in lines.items() if line.startswith("FAIL")]
    assert failing == [check], out
    assert detail in lines[check] and "fix: " in lines[check] and fix in lines[check].split("fix: ")[1], out
    after = {path: (path.stat().st_mode, path.read_bytes()) for path in host.folder.rglob("*") if path.is_file()}
    assert after == before  # the doctor changed nothing


class _SkewedHealth(http.server.BaseHTTPRequestHandler):
    """/health with a Date header an hour behind: a coordinator whose clock is wrong."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def date_time_string(self, timestamp: float | None = None) -> str:
        return formatdate((time.time() if timestamp is None else timestamp) - 3600, usegmt=True)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_coordinator_whose_clock_is_an_hour_off_fails_the_clock_check(host: Host) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SkewedHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code, lines, out = host.doctor({"--coordinator": url, "--ca-file": None})
    finally:
        server.shutdown()
    assert code == 2, out
    assert lines["coordinator"].startswith("ok    ") and "loopback http" in lines["coordinator"], out
    assert lines["clock"].startswith("FAIL  clock: ") and "timedatectl" in lines["clock"], out
    assert abs(float(lines["clock"].split()[2]) - 3600) < 2, out
