"""``coop-agent doctor``: the GPU host's preflight, run by the operator before anything else and by the unit before
each start (``ExecStartPre``). It takes the agent's own flags, and ``--plan`` for the checks that depend on the plan
(GPU memory, disk, the seed and the reference home), and prints one line a check; a failure prints its fix, and any
failure exits 2. It changes nothing and imports no torch."""

from __future__ import annotations

import datetime
import email.utils
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from agent import connection, jobs
from experiment.core import hostchecks, mounts
from experiment.core.errors import CoopError
from experiment.core.hostchecks import Finding, failed, passed
from experiment.core.plan import Plan, load_plan

MAX_SKEW_SECONDS = 5.0  # leases and deadlines are the coordinator's clock; a host this far off misreads them
HOST_INSTALL = "make setup-host && make vllm-venv (docs/operating.md, Install)"


@dataclass(frozen=True)
class Host:
    """What the doctor checks: the agent's flags, and the plan."""

    coordinator: str
    ca_file: Path | None
    token_file: Path | None
    work_dir: Path
    model_dir: Path
    reference_home: Path | None
    private_interface: str | None
    private_address: str | None
    ephemeral: tuple[Path, ...]
    plan_path: Path | None
    device: str  # cuda or cpu


def default_device() -> str:
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def findings(host: Host, environ: dict[str, str]) -> Iterator[Finding]:
    yield hostchecks.python()
    yield hostchecks.venv(Path(sys.prefix), HOST_INSTALL)
    yield hostchecks.venv(jobs.ROOT / ".venv-vllm", HOST_INSTALL)
    yield hostchecks.shared_libraries(jobs.ROOT / ".venv-vllm", "vllm", hostchecks.command_output)
    yield hostchecks.home(environ)
    if host.token_file is not None:
        yield hostchecks.secret(host.token_file, "token file")
    durable = {"work folder": host.work_dir, "seed folder": host.model_dir}
    if host.reference_home is not None:
        durable["reference home"] = host.reference_home
    yield hostchecks.durable(durable, (*mounts.KNOWN_EPHEMERAL, *host.ephemeral), mounts.read())
    plan = None
    if host.plan_path is not None:
        try:
            plan = load_plan(host.plan_path)
        except CoopError as exc:
            yield failed("plan", str(exc), f"give --plan the plan to be committed ({host.plan_path})")
    yield from _gpu(host, plan)
    if plan is not None:
        yield _disk(host, plan)
    if host.private_interface is not None and host.private_address is not None:
        yield hostchecks.private_link(host.private_interface, host.private_address, environ, hostchecks.command_output)
    yield from _coordinator(host)
    if plan is not None:
        yield _seed(host, plan)
        if plan.replay.source == "reference-home":
            yield _reference_home(host, plan)


def _gpu(host: Host, plan: Plan | None) -> Iterator[Finding]:
    if host.device != "cuda":
        yield passed("gpu", "a CPU host: no driver, compiler or GPU memory to check")
        return
    yield hostchecks.compiler()
    try:
        gpus = hostchecks.gpus(hostchecks.command_output)
    except CoopError as exc:
        yield failed("driver", str(exc), "install NVIDIA's driver (the DLAMI has it) and reboot")
        return
    yield hostchecks.driver(gpus)
    if plan is not None:
        from experiment.learning import memory, preflight  # torch-free: their rules only

        # nvidia-smi reads the card before any process of the run made its CUDA context, which the rank's own
        # preflight finds already taken.
        needed = preflight.memory_needed(plan, plan.training.pair_world_size) + memory.CUDA_CONTEXT_BYTES
        yield hostchecks.gpu_memory(gpus, needed, f"a rank of the {plan.training.pair_world_size}-rank pair")


def _disk(host: Host, plan: Plan) -> Finding:
    from experiment.learning import preflight

    steps = len(plan.training.checkpoint_steps)
    needed = preflight.disk_needed(plan, set()) * 2  # the single arm this host trains and its rank of the pair
    return hostchecks.disk(host.work_dir, needed, f"{2 * steps} checkpoints (two arms x {steps})")


def _coordinator(host: Host) -> Iterator[Finding]:
    """The coordinator answers /health over the configured TLS, and its clock agrees with this host's."""
    check = "coordinator"
    try:
        context = connection.tls_context(host.coordinator, host.ca_file)
        before = time.time()
        with httpx.Client(verify=context if context is not None else False, timeout=10.0) as client:
            response = client.get(f"{host.coordinator.rstrip('/')}/health")
        after = time.time()
    except CoopError as exc:
        yield failed(check, str(exc), "correct --coordinator and --ca-file in /etc/coop/agent.env")
        return
    except httpx.HTTPError as exc:
        yield failed(
            check,
            f"{host.coordinator}: {exc}",
            "start coop-coordinator, open its port to this host, and check that the CA file signed its certificate",
        )
        return
    if response.status_code != 200:
        yield failed(check, f"{host.coordinator}/health answered {response.status_code}", "see its journal")
        return
    yield passed(check, f"{host.coordinator} answers over {'TLS' if context else 'loopback http'}")
    stamp = response.headers.get("date")
    if stamp is None:
        yield failed("clock", "the coordinator sent no Date header", "upgrade the coordinator")
        return
    theirs = email.utils.parsedate_to_datetime(stamp).astimezone(datetime.UTC).timestamp()
    # The header has whole seconds: this host's midpoint is compared with the middle of the coordinator's second.
    skew = (before + after) / 2 - (theirs + 0.5)
    detail = f"{skew:+.1f} s against the coordinator"
    if abs(skew) > MAX_SKEW_SECONDS:
        yield failed("clock", detail, "run chrony or systemd-timesyncd on both hosts (timedatectl status)")
    else:
        yield passed("clock", detail)


def _seed(host: Host, plan: Plan) -> Finding:
    from experiment.learning import corpus
    from experiment.seed.seedfiles import verify_seed

    try:
        verify_seed(host.model_dir, corpus.seed_snapshot(plan))
    except CoopError as exc:
        return failed("seed", str(exc), "stage the seed again (docs/operating.md, Stage the seed)")
    return passed("seed", f"{host.model_dir} holds the plan's files")


def _reference_home(host: Host, plan: Plan) -> Finding:
    from experiment.learning import corpus

    fix = "copy the reference home again, byte for byte (docs/operating.md, The reference home)"
    if host.reference_home is None:
        return failed("reference home", "the plan reads a reference home; --reference-home is not given", fix)
    try:
        corpus.check_reference_home(plan, host.reference_home)
    except CoopError as exc:
        return failed("reference home", str(exc), fix)
    return passed("reference home", f"{host.reference_home} holds the plan's replay and retention files")
