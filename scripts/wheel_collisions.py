"""The CUDA locks' wheels, checked without installing them: for each of requirements/host-cuda.txt and
requirements/vllm-cuda.txt (one venv each), the wheel pip would take for CPython 3.11 on manylinux x86_64 among the
files whose hashes the lock names, and the paths each would write into the venv. Two wheels of one venv that write
the same path collide: pip overwrites the first one's file without a word, and which one a host ends up with depends
on the install order. A package with no wheel for that platform is reported as well.

    python3 scripts/wheel_collisions.py [--out bench/results/cuda-wheels.json]

Each wheel is found in PyPI's simple index by the lock's hash, and its file list read with HTTP range requests (the
zip's central directory, a few kB), so nothing gigabytes large is downloaded. `make lock` runs it after it writes
the locks. `make lock-check` (scripts/lock.py) fails, offline, while the report is for other locks than today's, or
names a collision not in ACCEPTED, or a package without a wheel for the target.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import urllib.request
import zipfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

try:
    from packaging.tags import Tag, compatible_tags, cpython_tags
    from packaging.utils import parse_wheel_filename
except ImportError:  # a bare Python: pip carries its own copy
    from pip._vendor.packaging.tags import Tag, compatible_tags, cpython_tags  # type: ignore[assignment]
    from pip._vendor.packaging.utils import parse_wheel_filename  # type: ignore[assignment]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lock import ROOT, WHEEL_LOCKS, WHEEL_REPORT, hashed

INDEX = "https://pypi.org/simple"
# Collisions known to be harmless, each with why: the lock check lets these alone pass.
ACCEPTED = {
    ("flashinfer-python", "torch-c-dlpack-ext"): "build_backend.py, a PEP 517 build backend each wheel carries along "
    "at the top of site-packages: only a build from a source tree imports it, never vLLM",
}
# CPython 3.11 on x86_64 Linux with glibc 2.35 (Ubuntu 22.04, the Deep Learning AMI's): pip's order of preference.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 4, -1)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
TAGS = [*cpython_tags((3, 11), ["cp311", "abi3", "none"], PLATFORMS), *compatible_tags((3, 11), "cp311", PLATFORMS)]
RANK = {tag: index for index, tag in enumerate(TAGS)}


class RemoteFile(io.RawIOBase):
    """A file on an HTTP server that answers range requests, read where zipfile seeks."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.position = url, size, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def read(self, count: int = -1) -> bytes:
        end = self.size if count < 0 else min(self.size, self.position + count)
        if end <= self.position:
            return b""
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.position}-{end - 1}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            data: bytes = answer.read()
        self.position += len(data)
        return data


def installed_path(name: str) -> str | None:
    """Where a wheel's member lands, relative to the venv's site-packages (scripts and data relative to the venv,
    marked so); None for the wheel's own .dist-info, which no other wheel writes."""
    first, _, rest = name.partition("/")
    if first.endswith(".dist-info"):
        return None
    if first.endswith(".data"):
        scheme, _, inner = rest.partition("/")
        return inner if scheme in {"purelib", "platlib"} else f"<{scheme}>/{inner}"
    return name


def best_wheel(filenames: list[str]) -> str | None:
    """The wheel pip takes for the target among ``filenames``: the one with the most preferred tag; None when none
    fits (only an sdist, or wheels of other platforms)."""
    fitting = []
    for filename in filenames:
        if filename.endswith(".whl"):
            tags: frozenset[Tag] = parse_wheel_filename(filename)[3]
            ranks = [RANK[tag] for tag in tags if tag in RANK]
            if ranks:
                fitting.append((min(ranks), filename))
    return min(fitting)[1] if fitting else None


def chosen_wheel(name: str, version: str, digests: list[str]) -> dict[str, Any]:
    """The file pip would take among those the lock names, and the paths it writes."""
    request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        files = json.load(answer)["files"]  # PEP 691: each file's name, url, size and hashes
    named = {f["filename"]: f for f in files if f["hashes"].get("sha256") in digests}
    best = best_wheel(sorted(named))
    if best is None:
        return {"package": name, "version": version, "fits": False, "files": sorted(named)}
    entry = named[best]
    with zipfile.ZipFile(RemoteFile(entry["url"], entry["size"])) as wheel:
        members = [member for member in wheel.namelist() if not member.endswith("/")]
    paths = sorted(filter(None, map(installed_path, members)))
    return {"package": name, "version": version, "fits": True, "file": best, "bytes": entry["size"], "paths": paths}


def check_lock(path: str) -> dict[str, Any]:
    text = (ROOT / path).read_text()
    pins = hashed(text)
    with ThreadPoolExecutor(16) as pool:
        wheels = list(pool.map(lambda item: chosen_wheel(item[0][0], item[0][1], item[1]), pins.items()))
    writers: dict[str, list[str]] = defaultdict(list)
    for wheel in wheels:
        for member in wheel.get("paths", []):
            writers[member].append(wheel["package"])
    shared: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for member, packages in writers.items():
        if len(packages) > 1:
            shared[tuple(sorted(packages))].append(member)
    collisions = [
        {"packages": list(packages), "paths": len(members), "first": sorted(members)[:5]}
        | ({"accepted": ACCEPTED[packages]} if packages in ACCEPTED else {})
        for packages, members in sorted(shared.items())
    ]
    return {
        "lock": path,
        "lock_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "packages": len(wheels),
        "wheel_bytes": sum(w.get("bytes", 0) for w in wheels),
        "collisions": collisions,
        "no_fitting_wheel": [{k: w[k] for k in ("package", "version", "files")} for w in wheels if not w["fits"]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / WHEEL_REPORT)
    args = parser.parse_args()
    report = {"target": "CPython 3.11, manylinux_2_35 x86_64", "locks": [check_lock(path) for path in WHEEL_LOCKS]}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for lock in report["locks"]:
        print(f"{lock['lock']}: {lock['packages']} packages, {lock['wheel_bytes'] / 1e9:.2f} GB of wheels")
        for collision in lock["collisions"]:
            accepted = f" (accepted: {collision['accepted']})" if "accepted" in collision else ""
            print(f"  collision: {' and '.join(collision['packages'])} both write {collision['paths']} paths, "
                  f"e.g. {collision['first'][0]}{accepted}")  # fmt: skip
        for unfit in lock["no_fitting_wheel"]:
            print(f"  no wheel for the target: {unfit['package']}=={unfit['version']} ({', '.join(unfit['files'])})")
    failing = [c for lock in report["locks"] for c in lock["collisions"] if "accepted" not in c]
    return 1 if failing or any(lock["no_fitting_wheel"] for lock in report["locks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
