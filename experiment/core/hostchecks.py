"""The checks of a host's doctor (``coop-agent doctor``, ``coop-server doctor``): each looks at one thing the run
needs of the host and gives one finding, which passes or fails, and a failure gives its fix. None of them changes
anything. Each takes what it looks at as arguments (a version, a folder, a command's output, a mounts table), so
that a test gives it real files and a fake ``nvidia-smi`` where the hardware is missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from experiment.core import mounts, secretfile
from experiment.core.errors import CoopError

GIB = 2**30
PYTHON = (3, 11)  # the locks' interpreter
# The CUDA wheels of requirements/host-cuda.txt and vllm-cuda.txt are CUDA 13 builds, which need this driver or later.
MIN_DRIVER_MAJOR = 580


@dataclass(frozen=True)
class Finding:
    check: str
    passed: bool
    detail: str
    fix: str = ""


def passed(check: str, detail: str) -> Finding:
    return Finding(check, True, detail)


def failed(check: str, detail: str, fix: str) -> Finding:
    return Finding(check, False, detail, fix)


def report(findings: Iterable[Finding], out: TextIO) -> int:
    """Print one line a finding (a failure's fix on the line after it); 0 when all passed, else 2."""
    code = 0
    for finding in findings:
        print(f"{'ok' if finding.passed else 'FAIL':4}  {finding.check}: {finding.detail}", file=out)
        if not finding.passed:
            print(f"      fix: {finding.fix}", file=out)
            code = 2
    out.flush()
    return code


def python(
    version: Sequence[int] = tuple(sys.version_info[:3]), prefix: str = sys.prefix, base: str = sys.base_prefix
) -> Finding:
    found = ".".join(str(part) for part in version[:3])
    if tuple(version[:2]) != PYTHON:
        wanted = ".".join(map(str, PYTHON))
        return failed(
            "python", f"Python {found}; the locks are for {wanted}", f"install python{wanted} and its venv module"
        )
    if prefix == base:
        return failed("python", f"Python {found} outside a venv ({prefix})", "run the venv's command (.venv/bin/...)")
    return passed("python", f"Python {found} in the venv {prefix}")


def venv(folder: Path, made_by: str) -> Finding:
    interpreter = folder / "bin" / "python"
    check = f"venv {folder.name}"
    if not os.access(interpreter, os.X_OK):
        return failed(check, f"{interpreter} is missing", made_by)
    return passed(check, f"{folder}")


def compiler(which: Callable[[str], str | None] = shutil.which, include: str | None = None) -> Finding:
    """A C compiler and Python.h: Triton compiles its launcher against them the first time a CUDA replica starts."""
    folder = Path(include or sysconfig.get_config_var("INCLUDEPY") or "")
    fix = "install a C compiler and Python 3.11's headers (Debian and Ubuntu: apt-get install gcc python3.11-dev)"
    cc = which("cc") or which("gcc")
    if cc is None:
        return failed("compiler", "no C compiler (cc, gcc) on PATH", fix)
    if not (folder / "Python.h").is_file():
        return failed("compiler", f"{cc}, but no Python.h in {folder}", fix)
    return passed("compiler", f"{cc} and {folder / 'Python.h'}")


# Shared libraries that compiled modules of the venvs load from the system, and the Debian and Ubuntu package of each:
# vLLM's CPU build links libnuma (a host without one fails its replica's first start, hours into the run).
SYSTEM_LIBRARIES = {"libnuma.so.1": "libnuma1", "libgomp.so.1": "libgomp1", "libstdc++.so.6": "libstdc++6"}


def shared_libraries(venv: Path, package: str, run: Callable[[list[str]], str]) -> Finding:
    """Each compiled module of ``package`` in ``venv`` finds the libraries it links against, by ``ldd``: on the
    system's library path, or shipped by a wheel of the venv (torch's, NVIDIA's), which Python loads first."""
    check = f"{package} libraries"
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    modules = sorted(found[0].joinpath(package).glob("*.so")) if found else []
    if not modules:
        return failed(check, f"{venv} holds no compiled module of {package}", f"install {venv.name} again (make)")
    shipped = {path.name for path in found[0].rglob("*.so*")}
    missing: dict[str, list[str]] = {}
    try:
        for module in modules:
            for line in run(["ldd", str(module)]).splitlines():
                name, _, where = line.strip().partition(" => ")
                if where.strip() == "not found" and name not in shipped:
                    missing.setdefault(name, []).append(module.name)
    except CoopError as exc:
        return failed(check, str(exc), "install ldd (Debian and Ubuntu: libc-bin)")
    if not missing:
        return passed(check, f"the {len(modules)} compiled modules of {package} find every library they link")
    detail = "; ".join(
        f"{name}, which {', '.join(users)} links, is on no library path" for name, users in missing.items()
    )
    packages = [SYSTEM_LIBRARIES.get(name) for name in missing]
    if all(packages):
        return failed(check, detail, f"apt-get install -y {' '.join(sorted(set(filter(None, packages))))}")
    return failed(check, detail, f"install the system packages that hold {', '.join(missing)} (apt-file search NAME)")


@dataclass(frozen=True)
class Gpu:
    name: str
    driver: str
    free_mib: int


def gpus(run: Callable[[list[str]], str]) -> list[Gpu]:
    """The GPUs ``nvidia-smi`` lists (``run`` gives a command's stdout, or raises CoopError)."""
    out = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.free", "--format=csv,noheader,nounits"])
    found = []
    for line in out.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3 or not fields[2].isdigit():
            raise CoopError(f"nvidia-smi printed {line!r}, not name, driver, free MiB")
        found.append(Gpu(fields[0], fields[1], int(fields[2])))
    return found


def command_output(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise CoopError(f"{argv[0]} is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise CoopError(f"{argv[0]} did not answer in 60 s") from None
    if done.returncode != 0:
        raise CoopError(f"{argv[0]} exited {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}")
    return done.stdout


def driver(found: Sequence[Gpu]) -> Finding:
    fix = f"install NVIDIA's driver {MIN_DRIVER_MAJOR} or later (the DLAMI's is), then reboot"
    if not found:
        return failed("driver", "nvidia-smi lists no GPU", fix)
    for gpu in found:
        major = gpu.driver.split(".")[0]
        if not major.isdigit() or int(major) < MIN_DRIVER_MAJOR:
            return failed(
                "driver", f"{gpu.name}: driver {gpu.driver}; the CUDA 13 wheels need {MIN_DRIVER_MAJOR} or later", fix
            )
    return passed("driver", ", ".join(f"{gpu.name} driver {gpu.driver}" for gpu in found))


def gpu_memory(found: Sequence[Gpu], needed_bytes: int, what: str) -> Finding:
    if not found:
        return failed("gpu memory", "no GPU", "run the doctor on the GPU host")
    free = max(gpu.free_mib for gpu in found) * 2**20
    if free < needed_bytes:
        return failed(
            "gpu memory",
            f"{free / GIB:.1f} GiB free; {what} needs {needed_bytes / GIB:.1f} GiB",
            "stop what holds the GPU (nvidia-smi lists its processes)",
        )
    return passed("gpu memory", f"{free / GIB:.1f} GiB free; {what} needs {needed_bytes / GIB:.1f} GiB")


def existing(folder: Path) -> Path:
    """``folder`` or its nearest ancestor that exists: the file system the folder is or will be on."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return candidate
    return Path("/")


def disk(folder: Path, needed_bytes: int, what: str) -> Finding:
    free = shutil.disk_usage(existing(folder)).free
    detail = f"{folder}: {free / GIB:.1f} GiB free; {what} needs {needed_bytes / GIB:.1f} GiB"
    if free < needed_bytes:
        return failed("disk", detail, f"grow the volume that holds {folder}, or free space on it")
    return passed("disk", detail)


def secret(path: Path, what: str) -> Finding:
    """A file holding a secret: this user's, and nobody else's to read (experiment.core.secretfile)."""
    try:
        secretfile.check(path, what)
    except CoopError as exc:
        user = secretfile.user_name(os.geteuid())
        return failed(what, str(exc), f"as root: chown {user}: {path} && chmod 600 {path}")
    return passed(what, f"{path} is {secretfile.user_name(os.geteuid())}'s alone")


def home(environ: Mapping[str, str] = os.environ) -> Finding:
    """HOME exists and this user may write it: Triton, vLLM and torch's compile caches write there."""
    folder = environ.get("HOME", "")
    fix = "give the service's user a HOME it owns (useradd --create-home --home-dir DIR)"
    if not folder:
        return failed("home", "HOME is not set", fix)
    path = Path(folder)
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        return failed("home", f"HOME {path} is not a folder this user can write", fix)
    return passed("home", f"HOME {path} is writable")


def durable(folders: Mapping[str, Path], ephemeral: Iterable[Path], table: list[mounts.Mount]) -> Finding:
    lines = mounts.ephemeral_folders(folders, ephemeral, table)
    if lines:
        return failed("storage", "; ".join(lines), "mount a durable (EBS) volume and point the folders at it")
    held = ", ".join(f"{folder} on {mounts.mount_of(folder, table).point}" for folder in folders.values())
    return passed("storage", f"durable: {held}")


def addresses(interface: str, run: Callable[[list[str]], str]) -> list[str]:
    """The IPv4 and IPv6 addresses of ``interface``, by ``ip -json address``."""
    entries = json.loads(run(["ip", "-json", "address", "show", "dev", interface]) or "[]")
    return [info["local"] for entry in entries for info in entry.get("addr_info", []) if "local" in info]


def private_link(interface: str, address: str, environ: Mapping[str, str], run: Callable[[list[str]], str]) -> Finding:
    check = "private link"
    fix = f"give {interface} the address {address} (the second network interface), or correct agent.env"
    try:
        held = addresses(interface, run)
    except CoopError as exc:
        return failed(check, f"interface {interface}: {exc}", fix)
    if address not in held:
        return failed(check, f"{interface} holds {', '.join(held) or 'no address'}, not {address}", fix)
    for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if environ.get(variable, interface) != interface:
            return failed(
                check,
                f"{variable}={environ[variable]} names another interface than {interface}",
                f"remove {variable} from the service's environment: the agent sets it to --private-interface",
            )
    return passed(check, f"{interface} holds {address}")
