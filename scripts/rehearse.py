"""The operator's day one on booted hosts (root only): Debian 12 containers with systemd as init
(``systemd-nspawn --boot``), each in a network namespace of its own (scripts/namespaces.py), set up with the
runbook's own commands, and the agent's unit started by systemd as the ``coop`` user.

The commands are docs/operating.md's shell blocks marked ``rehearsed=NAME``, extracted and run as they are, so the
runbook cannot drift from what was rehearsed. Each host's ``/var/lib/coop`` is a folder of this machine that
outlives the container (the durable volume) and its ``/opt/dlami/nvme`` a tmpfs (the instance store). A host has no
route to a package registry: pip reads the locked wheels from a wheelhouse bind-mounted read-only, still with
``--require-hashes``. The coordinator runs on this machine in its own namespace, over TLS.

    python3 scripts/rehearse.py [--out FILE] [--keep]

It prints one JSON line a step as it ends, then the verdict; a failed step names itself and prints the host's
journal. The steps, their seconds and the unit's user go to ``--out`` (bench/results/rehearsal-cpu.json).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path("/var/cache/coop-rehearsal")
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = "systemd,systemd-sysv,dbus,iproute2,python3,python3-venv,make,git,sudo,ca-certificates,procps"
LOCKS = ("requirements/host-cpu.txt", "requirements/vllm-cpu.txt")
RUNBOOK = ROOT / "docs" / "operating.md"
NAMESPACES = [sys.executable, str(ROOT / "scripts" / "namespaces.py")]


def runbook_blocks(text: str) -> dict[str, str]:
    """The runbook's shell blocks marked ``rehearsed=NAME``, by name, each with the list item's indent removed."""
    blocks = {}
    for match in re.finditer(r"^( *)```sh rehearsed=([\w-]+)\n(.*?)^\1```", text, re.S | re.M):
        indent = len(match.group(1))
        blocks[match.group(2)] = "".join(line[indent:] + "\n" for line in match.group(3).splitlines())
    return blocks


@dataclass
class Step:
    name: str
    seconds: float
    passed: bool
    detail: str = ""


@dataclass
class Rehearsal:
    steps: list[Step] = field(default_factory=list)
    unit_users: dict[str, str] = field(default_factory=dict)  # host -> the user its coop-agent unit's process runs as

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[list[str]]:
        """Time the step; its body appends its detail; an exception fails it (and the rehearsal)."""
        detail: list[str] = []
        start = time.monotonic()
        try:
            yield detail
        except BaseException as exc:
            self._record(Step(name, time.monotonic() - start, False, f"{exc}"))
            raise
        self._record(Step(name, time.monotonic() - start, True, "; ".join(detail)))

    def _record(self, step: Step) -> None:
        self.steps.append(step)
        print(json.dumps({"step": step.name, "seconds": round(step.seconds, 1), "passed": step.passed,
                          "detail": step.detail}), flush=True)  # fmt: skip


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


def certificates(folder: Path, address: str) -> dict[str, Path]:
    """A CA and the coordinator's certificate for ``address``, made as docs/operating.md makes them."""
    folder.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)
    try:
        run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-subj", "/CN=coop CA", "-keyout", "ca.key", "-out", "ca.pem",
             "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign"], cwd=folder)  # fmt: skip
        run(
            [
                "openssl",
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-subj",
                "/CN=coop coordinator",
                "-keyout",
                "coordinator.key",
                "-out",
                "coordinator.csr",
            ],
            cwd=folder,
        )
        (folder / "coordinator.ext").write_text(
            f"subjectAltName=IP:{address}\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
        )
        run(
            [
                "openssl",
                "x509",
                "-req",
                "-in",
                "coordinator.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "coordinator.ext",
                "-out",
                "coordinator.pem",
            ],
            cwd=folder,
        )
    finally:
        os.umask(old)
    (folder / "ca.pem").chmod(0o644)
    return {"ca": folder / "ca.pem", "cert": folder / "coordinator.pem", "key": folder / "coordinator.key"}


class Coordinator:
    """coop-server on this machine, in the coordinator's namespace, over TLS, with a SQLite home of its own."""

    def __init__(self, folder: Path, namespace: str, address: str, tls: dict[str, Path]) -> None:
        self.url = f"https://{address}:8443"
        self.ca = tls["ca"]
        self.env = {**os.environ, "COOP_HOME": str(folder), "COOP_REAP_SECONDS": "1"}
        self.log = (folder.parent / "coordinator.log").open("ab")
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", namespace, str(ROOT / ".venv" / "bin" / "coop-server"), "serve", "--migrate",
             "--host", address, "--port", "8443", "--certfile", str(tls["cert"]), "--keyfile", str(tls["key"])],
            env=self.env, stdout=self.log, stderr=self.log, cwd=ROOT,
        )  # fmt: skip
        self.wait(lambda: self.get("/health") is not None, 60, "the coordinator to answer")
        self.operator = self.token("operator", "operator")

    def token(self, role: str, name: str) -> str:
        done = run([str(ROOT / ".venv" / "bin" / "coop-server"), "token", "create", "--role", role, "--name", name],
                   env=self.env, cwd=ROOT)  # fmt: skip
        return done.stdout.strip()

    def get(self, path: str) -> object | None:
        """The JSON answer of ``path`` (with the operator's token once there is one), or None when none came."""
        headers = ["-H", f"Authorization: Bearer {self.operator}"] if hasattr(self, "operator") else []
        done = subprocess.run(["curl", "-sf", "--max-time", "5", "--cacert", str(self.ca), *headers, self.url + path],
                              capture_output=True, text=True)  # fmt: skip
        return json.loads(done.stdout) if done.returncode == 0 else None

    @staticmethod
    def wait(condition: object, seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if condition():  # type: ignore[operator]
                return
            time.sleep(0.5)
        raise RuntimeError(f"waited {seconds:.0f} s for {what}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def agent_env(coordinator: Coordinator, topology: dict[str, object], host: dict[str, str]) -> str:
    values = {
        "COOP_COORDINATOR": coordinator.url,
        "COOP_NAME": host["name"],
        "COOP_PUBLIC_ADDRESS": host["public_address"],
        "COOP_PRIVATE_INTERFACE": host["private_interface"],
        "COOP_PRIVATE_ADDRESS": host["private_address"],
        "COOP_SEED_DIR": "/var/lib/coop/seed/tiny",  # the tiny seed stands for SmolLM2-1.7B-Instruct
        "COOP_PLAN": "/opt/coop/plans/local.toml",
    }
    return "".join(f"{key}={value}\n" for key, value in values.items())


def _last_seen(coordinator: Coordinator, name: str) -> str | None:
    agents = coordinator.get("/api/agents") or []
    return next((a["last_seen_at"] for a in agents if a["name"] == name), None)  # type: ignore[index]


def main_process_user(host: Host, unit: str) -> str:
    pid = host.sh(f"systemctl show -p MainPID --value {unit}").stdout.strip()
    return host.sh(f"ps -o user= -p {pid}").stdout.strip() if pid not in {"", "0"} else ""


def rehearse(rehearsal: Rehearsal, work: Path, prefix: str, hosts: list[Host], servers: list[Coordinator]) -> None:
    blocks = runbook_blocks(RUNBOOK.read_text())
    with rehearsal.step("rootfs") as detail:
        base = rootfs()
        detail.append(f"debootstrap --variant=minbase {SUITE} with {PACKAGES}, cached in {base}")
    with rehearsal.step("wheelhouse") as detail:
        wheels = wheelhouse()
        detail.append(f"{len(list(wheels.iterdir()))} files of {', '.join(LOCKS)}")
    with rehearsal.step("network") as detail:
        topology = json.loads(run([*NAMESPACES, "up", "--prefix", prefix, "--hosts", "2"]).stdout)
        detail.append(f"coordinator {topology['coordinator_address']}, hosts on public and private links")
    with rehearsal.step("coordinator") as detail:
        tls = certificates(work / "tls", topology["coordinator_address"])
        coordinator = Coordinator(work / "coordinator", topology["coordinator_namespace"],
                                  topology["coordinator_address"], tls)  # fmt: skip
        servers.append(coordinator)
        detail.append(f"{coordinator.url}, TLS with the rehearsal's CA")
    spec = topology["hosts"][0]
    host = Host(spec["name"], spec["namespace"], work / spec["name"])
    hosts.append(host)
    secrets = work / "secrets" / host.name
    secrets.mkdir(parents=True)
    (secrets / "agent.token").write_text(coordinator.token("agent", host.name) + "\n")
    shutil.copyfile(tls["ca"], secrets / "ca.pem")
    binds = {ROOT: "/srv/coop-repo", wheels: "/srv/wheelhouse", secrets: "/srv/secrets"}
    with rehearsal.step(f"boot {host.name}") as detail:
        host.boot(base, binds)
        detail.append(host.sh("systemctl is-system-running").stdout.strip())
    with rehearsal.step("runbook: host-setup"):
        host.sh(blocks["host-setup"])
    with rehearsal.step("runbook: install-host") as detail:
        pip = {"REPOSITORY": "/srv/coop-repo", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/srv/wheelhouse"}
        host.sh(blocks["install-host"], env=pip, timeout=1800)
        detail.append(host.sh("/opt/coop/.venv/bin/python -c 'import torch; print(torch.__version__)'").stdout.strip())
    with rehearsal.step("runbook: agent-secrets"):
        host.sh(blocks["agent-secrets"], cwd="/srv/secrets")
    with rehearsal.step("stage the seed"):
        seed = "/var/lib/coop/seed/tiny"
        host.sh(f"install -d {seed} && cp -r /opt/coop/seeds/tiny/. {seed} && chown -R coop:coop /var/lib/coop/seed")
    with rehearsal.step("runbook: agent-unit") as detail:
        (host.merged / "etc" / "coop" / "agent.env").write_text(agent_env(coordinator, topology, spec))
        host.sh(blocks["agent-unit"], cwd="/opt/coop")
        Coordinator.wait(lambda: host.name in {a["name"] for a in coordinator.get("/api/agents") or []}, 180,
                         f"{host.name} to register")  # fmt: skip
        rehearsal.unit_users[host.name] = main_process_user(host, "coop-agent")
        detail.append(f"registered; its unit's process runs as {rehearsal.unit_users[host.name]}")
    with rehearsal.step("a token others can read is refused at start") as detail:
        host.sh("chmod 644 /etc/coop/agent-token && systemctl restart coop-agent", check=False)
        Coordinator.wait(lambda: "is open to users other than coop" in host.journal("coop-agent"), 60, "the refusal")
        detail.append(next(line for line in host.journal("coop-agent").splitlines() if "open to users" in line))
        host.sh("chmod 600 /etc/coop/agent-token && systemctl reset-failed coop-agent; systemctl restart coop-agent")
        Coordinator.wait(lambda: host.sh("systemctl is-active coop-agent", check=False).stdout.strip() == "active",
                         120, "the agent active again")  # fmt: skip
    with rehearsal.step("a power-off keeps the durable volume and erases the instance store") as detail:
        host.sh("touch /opt/dlami/nvme/scratch && systemctl poweroff", check=False)
        host.wait_powered_off(120)
        host.boot(base, binds)
        spool = host.sh("ls /var/lib/coop/work").stdout.split()
        scratch = host.sh("ls -A /opt/dlami/nvme").stdout.split()
        if "spool.sqlite3" not in spool or scratch:
            raise RuntimeError(f"after the boot, /var/lib/coop/work holds {spool}, /opt/dlami/nvme holds {scratch}")
        seen = _last_seen(coordinator, host.name)
        Coordinator.wait(lambda: _last_seen(coordinator, host.name) != seen, 120, f"{host.name} heard from again")
        user = main_process_user(host, "coop-agent")
        detail.append(f"the spool kept, the instance store empty, the agent active again as {user}")
    with rehearsal.step("the deadline timer powers the host off") as detail:
        host.sh(blocks["deadline-timer"], cwd="/opt/coop")
        # A drop-in that brings the 8 hours after boot down to 5 s after the timer starts (to the second: the
        # unit's own accuracy is a minute).
        dropin = host.merged / "etc" / "systemd" / "system" / "coop-deadline.timer.d"
        dropin.mkdir(parents=True, exist_ok=True)
        (dropin / "rehearsal.conf").write_text("[Timer]\nOnBootSec=\nOnActiveSec=5s\nAccuracySec=1s\n")
        host.sh("systemctl daemon-reload && systemctl restart coop-deadline.timer")
        host.wait_powered_off(120)
        detail.append("powered off by coop-deadline.service")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the steps and the verdict here (JSON)")
    parser.add_argument("--keep", action="store_true", help="leave the hosts' folders for a look afterwards")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("rehearse: booting hosts needs root", file=sys.stderr)
        return 2
    missing = [
        tool for tool in ("debootstrap", "systemd-nspawn", "nsenter", "openssl", "curl") if not shutil.which(tool)
    ]
    if missing:
        print(f"rehearse: {', '.join(missing)} missing: apt-get install debootstrap systemd-container "
              "util-linux openssl curl", file=sys.stderr)  # fmt: skip
        return 2
    rehearsal, hosts, servers = Rehearsal(), [], []
    work = Path(tempfile.mkdtemp(prefix="coop-rehearsal-"))
    prefix = f"coop-rh-{os.getpid()}"
    started = time.monotonic()
    failed = None
    try:
        rehearse(rehearsal, work, prefix, hosts, servers)
    except Exception as exc:
        failed = rehearsal.steps[-1].name if rehearsal.steps else "start"
        print(f"rehearse: step {failed!r} failed: {exc}", file=sys.stderr)
        for host in hosts:
            if host.leader:
                print(f"--- the journal of {host.name}\n{host.journal()}", file=sys.stderr)
    finally:
        for host in hosts:
            host.stop()
        for server in servers:
            server.stop()
        subprocess.run([*NAMESPACES, "down", "--prefix", prefix], capture_output=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    verdict = {"passed": failed is None, "failed_step": failed, "seconds": round(time.monotonic() - started, 1),
               "unit_users": rehearsal.unit_users, "steps": [asdict(step) | {"seconds": round(step.seconds, 1)}
                                              for step in rehearsal.steps]}  # fmt: skip
    print(json.dumps({"verdict": verdict["passed"], "seconds": verdict["seconds"], "failed_step": failed}))
    if args.out:
        args.out.write_text(json.dumps(verdict, indent=2) + "\n")
    return 0 if failed is None else 1


if __name__ == "__main__":
    sys.exit(main())
