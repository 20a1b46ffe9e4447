"""Booted throwaway hosts for the rehearsal (scripts/rehearse.py, root): a Debian 12 root file system made once by
debootstrap, the locks' wheels and the web UI's npm packages kept beside it, each host an overlay over that root
booted with systemd as init by ``systemd-nspawn --boot`` in a network namespace of its own; and a small client of
the coordinator's API over TLS."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path("/var/cache/coop-rehearsal")
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# The runbook's prerequisites of a host without a GPU (step 0, less the compiler and headers only Triton needs).
PACKAGES = "systemd,systemd-sysv,dbus,iproute2,python3,python3-venv,make,git,sudo,ca-certificates,procps,libnuma1"
LOCKS = ("requirements/host-cpu.txt", "requirements/vllm-cpu.txt")
# This machine's Node.js stands for the coordinator host's `apt-get install nodejs npm` (the hosts have no route to
# a registry): the binary and npm, bound read-only, with npm's cache filled here from package-lock.json.
NODE = {
    Path("/usr/bin/node"): "/usr/local/bin/node",
    Path("/usr/lib/node_modules/npm"): "/usr/local/lib/node_modules/npm",
}


def run(argv: list[str], **options: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, **options)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
    return done


def rootfs() -> Path:
    """Debian 12 with systemd, made once by debootstrap and kept in CACHE (each host gets an overlay over it)."""
    target = CACHE / f"rootfs-{SUITE}-{hashlib.sha256(PACKAGES.encode()).hexdigest()[:12]}"
    if not (target / "usr" / "lib" / "systemd" / "systemd").exists():
        draft = target.with_name(target.name + ".draft")
        shutil.rmtree(draft, ignore_errors=True)
        draft.parent.mkdir(parents=True, exist_ok=True)
        run(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, str(draft), MIRROR])
        shutil.rmtree(target, ignore_errors=True)
        draft.rename(target)
    return target


def wheelhouse() -> Path:
    """Every file the locks name, downloaded with this machine's pip settings and checked against their hashes."""
    folder = CACHE / "wheelhouse"
    stamp = folder / ".locks"  # the locks' sha256 once every file they name is here
    digest = hashlib.sha256(b"".join((ROOT / lock).read_bytes() for lock in LOCKS)).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return folder
    for lock in LOCKS:
        run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
             "-r", str(ROOT / lock), "-d", str(folder)])  # fmt: skip
    stamp.write_text(digest)
    return folder


class Host:
    """A booted container: an overlay over the shared rootfs, its durable folder, in its own network namespace."""

    def __init__(self, name: str, namespace: str, folder: Path) -> None:
        self.name, self.namespace, self.folder = name, namespace, folder
        self.merged = folder / "merged"
        self.durable = folder / "durable"  # /var/lib/coop: outlives a power-off, as an EBS volume does
        self.process: subprocess.Popen[bytes] | None = None
        self.leader = 0

    def boot(self, base: Path, binds: dict[Path, str]) -> None:
        for part in ("upper", "work", "merged", "durable"):
            (self.folder / part).mkdir(parents=True, exist_ok=True)
        if not os.path.ismount(self.merged):
            lower, upper, work = base, self.folder / "upper", self.folder / "work"
            run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower},upperdir={upper},workdir={work}",
                 str(self.merged)])  # fmt: skip
        (self.merged / "etc" / "hostname").write_text(self.name + "\n")
        argv = ["systemd-nspawn", "-D", str(self.merged), "--boot", "--register=no", "--keep-unit",
                "--machine", self.name, f"--network-namespace-path=/run/netns/{self.namespace}",
                f"--bind={self.durable}:/var/lib/coop", "--tmpfs=/opt/dlami/nvme"]  # fmt: skip
        argv += [f"--bind-ro={source}:{target}" for source, target in binds.items()]
        console = (self.folder / "console.log").open("ab")
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=console, stderr=console)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pgrep = ["pgrep", "-P", str(self.process.pid)]
            children = subprocess.run(pgrep, capture_output=True, text=True).stdout.split()
            if children:
                self.leader = int(children[0])
                state = self.sh("systemctl is-system-running --wait", check=False).stdout.strip()
                if state in {"running", "degraded"}:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not boot in 60 s: {(self.folder / 'console.log').read_text()[-2000:]}")

    def sh(
        self, script: str, cwd: str = "/", env: dict[str, str] | None = None, check: bool = True, timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        """``script`` by /bin/sh as root inside the host, with a login's PATH (nsenter into every namespace)."""
        environment = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
                       "LANG": "C.UTF-8", **(env or {})}  # fmt: skip
        argv = [
            "nsenter",
            "-t",
            str(self.leader),
            "-a",
            "env",
            "-i",
            *[f"{key}={value}" for key, value in environment.items()],
            "/bin/sh",
            "-ec",
            f"cd {cwd}\n{script}",
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(
                f"on {self.name}, exit {done.returncode}:\n{script}\n{(done.stderr or done.stdout)[-3000:]}"
            )
        return done

    def wait_powered_off(self, seconds: float) -> None:
        """Wait for the container's init to end (a power-off), then unmount its overlay."""
        assert self.process is not None
        try:
            self.process.wait(seconds)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{self.name} still runs {seconds:.0f} s after its power-off") from None
        self.leader = 0
        subprocess.run(["umount", str(self.merged)], check=False)

    def journal(self, unit: str | None = None) -> str:
        where = f"-u {unit}" if unit else ""
        return self.sh(f"journalctl --no-pager -n 80 {where}", check=False).stdout

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # nspawn asks the container's init to power off
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if os.path.ismount(self.merged):
            subprocess.run(["umount", str(self.merged)], check=False)


def npm_cache() -> Path:
    """npm's cache holding every package of package-lock.json, filled once by ``npm ci`` here (kept in CACHE)."""
    folder = CACHE / "npm"
    stamp = folder / ".lock"
    digest = hashlib.sha256((ROOT / "package-lock.json").read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return folder
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(ROOT / name, Path(scratch) / name)
        run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error", "--cache", str(folder)], cwd=scratch)
    stamp.write_text(digest)
    return folder


class Api:
    """GET on the coordinator's API over TLS with the rehearsal's CA, as the operator."""

    def __init__(self, url: str, ca: Path, token: str | None = None) -> None:
        self.url, self.token = url, token
        self.context = ssl.create_default_context(cafile=str(ca))

    def get(self, path: str) -> Any:
        """The JSON answer, or None when none came (not yet up, refused, cut)."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        request = urllib.request.Request(self.url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5, context=self.context) as answer:
                return json.loads(answer.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def agents(self) -> dict[str, dict[str, Any]]:
        return {agent["name"]: agent for agent in self.get("/api/agents") or []}


def wait(condition: Callable[[], object], seconds: float, what: str, every: float = 0.5) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(every)
    raise RuntimeError(f"waited {seconds:.0f} s for {what}")


def main_process_user(host: Host, unit: str) -> str:
    """The user the unit's main process runs as ('' while it has none)."""
    pid = host.sh(f"systemctl show -p MainPID --value {unit}").stdout.strip()
    return host.sh(f"ps -o user= -p {pid}").stdout.strip() if pid not in {"", "0"} else ""
