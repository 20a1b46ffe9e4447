"""The operator's day one on booted hosts (root only): Debian 12 containers with systemd as init
(``systemd-nspawn --boot``, scripts/bootedhosts.py), each in a network namespace of its own (scripts/namespaces.py),
set up with the runbook's own commands, every unit run by systemd as the ``coop`` user.

The commands are docs/operating.md's shell blocks marked ``rehearsed=NAME``, extracted and run as they are, so the
runbook cannot drift from what was rehearsed. Each host's ``/var/lib/coop`` is a folder of this machine that
outlives the container (the durable volume) and its ``/opt/dlami/nvme`` a tmpfs (the instance store). A host has no
route to a package registry: pip reads the locked wheels from a wheelhouse bind-mounted read-only, still with
``--require-hashes``.

    python3 scripts/rehearse.py [--guard] [--out FILE] [--keep]

The whole rehearsal boots three hosts (the coordinator, host-a, host-b), stands the coordinator and both agents up
under their units, stages the tiny seed and a reference home, and runs the CPU reference-home plan (plans/local.toml
reading its conversations from the reference home) to its report, which the operator recomputes from the exported
evidence; on the way, one host is powered off in the middle of a single's training and the other's agent restarted
in the middle of the pair's, and each run resumes from its checkpoint. ``--guard`` (what make test runs) boots one
GPU host beside a coordinator process of this machine: the install, the secrets and the agent's unit, a refused
token, a power-off and the deadline timer.

It prints one JSON line a step as it ends, then the verdict; a failed step names itself and prints each host's
journal. The steps, their seconds and the units' users go to ``--out`` (bench/results/rehearsal-cpu.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bootedhosts import (
    LOCKS,
    NODE,
    PACKAGES,
    ROOT,
    SUITE,
    Api,
    Host,
    main_process_user,
    npm_cache,
    rootfs,
    run,
    wait,
    wheelhouse,
)

RUNBOOK = ROOT / "docs" / "operating.md"
NAMESPACES = [sys.executable, str(ROOT / "scripts" / "namespaces.py")]
SEED = "/var/lib/coop/seed/tiny"  # the tiny seed stands for SmolLM2-1.7B-Instruct
PLAN = "/opt/coop/plans/reference.toml"  # where the operator records the plan on each host (runbook step 3)
PIP = {"REPOSITORY": "/srv/coop-repo", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/srv/wheelhouse"}
SINGLES = ("clean-single", "damaged-single")
PAIR = "clean-pair"
FINAL = {"reported", "failed", "halted"}
# The operator's copies on each GPU host (runbook step 3): the seed folder, and the previous run's replay and
# retention conversations under the reference home's names (plans/local-reference's stand for them).
STAGE = f"""
install -d {SEED} && cp -r /opt/coop/seeds/tiny/. {SEED}
cp /srv/coop-repo/plans/local-reference/replay.jsonl /var/lib/coop/reference-home/train-replay.jsonl
cp /srv/coop-repo/plans/local-reference/retention.jsonl /var/lib/coop/reference-home/retention-probes.jsonl
chown -R coop:coop /var/lib/coop/seed /var/lib/coop/reference-home
"""


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
    unit_users: dict[str, str] = field(default_factory=dict)  # host -> the user its coop unit's process runs as

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


@dataclass
class Stage:
    """What a rehearsal holds while it runs, for main to stop and clean up whatever happens."""

    work: Path
    prefix: str
    hosts: list[Host] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)


def prepare(rehearsal: Rehearsal, stage: Stage) -> tuple[Path, Path, dict[str, Any]]:
    """The root file system and the wheelhouse (both cached), and the namespaces of a coordinator and two hosts."""
    with rehearsal.step("rootfs") as detail:
        base = rootfs()
        detail.append(f"debootstrap --variant=minbase {SUITE} with {PACKAGES}, cached in {base}")
    with rehearsal.step("wheelhouse") as detail:
        wheels = wheelhouse()
        detail.append(f"{len(list(wheels.iterdir()))} files of {', '.join(LOCKS)}")
    with rehearsal.step("network") as detail:
        topology: dict[str, Any] = json.loads(run([*NAMESPACES, "up", "--prefix", stage.prefix, "--hosts", "2"]).stdout)
        detail.append(f"coordinator {topology['coordinator_address']}, hosts on public and private links")
    return base, wheels, topology


def certificates(blocks: dict[str, str], folder: Path, address: str) -> dict[str, Path]:
    """The CA and the coordinator's key and certificate for ``address``, made by the runbook's own blocks on the
    operator's machine (this one)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("ca", "coordinator-certificate"):
        run(["/bin/sh", "-ec", blocks[name]], cwd=folder, env={**os.environ, "COORDINATOR_ADDRESS": address})
    return {"ca": folder / "ca.pem", "cert": folder / "coordinator.pem", "key": folder / "coordinator.key"}


def agent_env(url: str, host: dict[str, str], plan: str) -> str:
    values = {
        "COOP_COORDINATOR": url,
        "COOP_NAME": host["name"],
        "COOP_PUBLIC_ADDRESS": host["public_address"],
        "COOP_PRIVATE_INTERFACE": host["private_interface"],
        "COOP_PRIVATE_ADDRESS": host["private_address"],
        "COOP_SEED_DIR": SEED,
        "COOP_PLAN": plan,
    }
    return "".join(f"{key}={value}\n" for key, value in values.items())


def power_cycle(host: Host, base: Path, binds: dict[Path, str], api: Api) -> str:
    """Power the host off from inside, boot it again, and check what a stop keeps: the durable volume (the agent's
    spool) and not the instance store; then wait for the agent to be heard from again."""
    seen = api.agents().get(host.name, {}).get("last_seen_at")
    host.sh("touch /opt/dlami/nvme/scratch && systemctl poweroff", check=False)
    host.wait_powered_off(120)
    host.boot(base, binds)
    spool = host.sh("ls /var/lib/coop/work").stdout.split()
    scratch = host.sh("ls -A /opt/dlami/nvme").stdout.split()
    if "spool.sqlite3" not in spool or scratch:
        raise RuntimeError(f"after the boot, /var/lib/coop/work holds {spool}, /opt/dlami/nvme holds {scratch}")
    wait(lambda: api.agents().get(host.name, {}).get("last_seen_at") not in (None, seen), 180,
         f"{host.name}'s agent heard from again")  # fmt: skip
    user = main_process_user(host, "coop-agent")
    return f"the spool kept, the instance store empty, the agent active again as {user}"


def rehearse_guard(rehearsal: Rehearsal, stage: Stage) -> None:
    """One booted GPU host beside a coordinator process of this machine (what make test runs)."""
    blocks = runbook_blocks(RUNBOOK.read_text())
    base, wheels, topology = prepare(rehearsal, stage)
    work = stage.work
    with rehearsal.step("coordinator") as detail:
        address = topology["coordinator_address"]
        tls = certificates(blocks, work / "tls", address)
        home = work / "coordinator"
        env = {**os.environ, "COOP_HOME": str(home), "COOP_REAP_SECONDS": "1"}
        server = [str(ROOT / ".venv" / "bin" / "coop-server")]
        run([*server, "migrate"], env=env, cwd=ROOT)
        log = (work / "coordinator.log").open("ab")
        stage.processes.append(subprocess.Popen(
            ["ip", "netns", "exec", topology["coordinator_namespace"], *server, "serve", "--host", address,
             "--port", "8443", "--certfile", str(tls["cert"]), "--keyfile", str(tls["key"])],
            env=env, stdout=log, stderr=log, cwd=ROOT,
        ))  # fmt: skip
        token = {name: run([*server, "token", "create", "--role", role, "--name", name], env=env).stdout.strip()
                 for role, name in (("operator", "operator"), ("agent", "host-a"))}  # fmt: skip
        api = Api(f"https://{address}:8443", tls["ca"], token["operator"])
        wait(lambda: api.get("/health") is not None, 60, "the coordinator to answer")
        detail.append(f"{api.url}, TLS with the rehearsal's CA")
    spec = topology["hosts"][0]
    host = Host(spec["name"], spec["namespace"], work / spec["name"])
    stage.hosts.append(host)
    secrets = work / "secrets" / host.name
    secrets.mkdir(parents=True)
    (secrets / "agent.token").write_text(token[host.name] + "\n")
    shutil.copyfile(tls["ca"], secrets / "ca.pem")
    binds = {ROOT: "/srv/coop-repo", wheels: "/srv/wheelhouse", secrets: "/srv/secrets"}
    with rehearsal.step(f"boot {host.name}") as detail:
        host.boot(base, binds)
        detail.append(host.sh("systemctl is-system-running").stdout.strip())
    with rehearsal.step("runbook: host-setup"):
        host.sh(blocks["host-setup"])
    with rehearsal.step("runbook: install-host") as detail:
        host.sh(blocks["install-host"], env=PIP, timeout=1800)
        detail.append(host.sh("/opt/coop/.venv/bin/python -c 'import torch; print(torch.__version__)'").stdout.strip())
    with rehearsal.step("runbook: agent-secrets"):
        host.sh(blocks["agent-secrets"], cwd="/srv/secrets")
    with rehearsal.step("stage the seed"):
        host.sh(f"install -d {SEED} && cp -r /opt/coop/seeds/tiny/. {SEED} && chown -R coop:coop /var/lib/coop/seed")
    with rehearsal.step("runbook: agent-unit") as detail:
        (host.merged / "etc" / "coop" / "agent.env").write_text(agent_env(api.url, spec, "/opt/coop/plans/local.toml"))
        host.sh(blocks["agent-unit"], cwd="/opt/coop")
        wait(lambda: host.name in api.agents(), 180, f"{host.name} to register")
        rehearsal.unit_users[host.name] = main_process_user(host, "coop-agent")
        detail.append(f"registered; its unit's process runs as {rehearsal.unit_users[host.name]}")
    with rehearsal.step("a token others can read is refused at start") as detail:
        host.sh("chmod 644 /etc/coop/agent-token && systemctl restart coop-agent", check=False)
        wait(lambda: "is open to users other than coop" in host.journal("coop-agent"), 60, "the refusal")
        detail.append(next(line for line in host.journal("coop-agent").splitlines() if "open to users" in line))
        host.sh("chmod 600 /etc/coop/agent-token && systemctl reset-failed coop-agent; systemctl restart coop-agent")
        wait(lambda: host.sh("systemctl is-active coop-agent", check=False).stdout.strip() == "active", 120,
             "the agent active again")  # fmt: skip
    with rehearsal.step("a power-off keeps the durable volume and erases the instance store") as detail:
        detail.append(power_cycle(host, base, binds, api))
    with rehearsal.step("the deadline timer powers the host off") as detail:
        deadline_timer(host, blocks)
        detail.append("powered off by coop-deadline.service")


def deadline_timer(host: Host, blocks: dict[str, str]) -> None:
    host.sh(blocks["deadline-timer"], cwd="/opt/coop")
    # A drop-in that brings the 8 hours after boot down to 5 s after the timer starts (to the second: the unit's own
    # accuracy is a minute).
    dropin = host.merged / "etc" / "systemd" / "system" / "coop-deadline.timer.d"
    dropin.mkdir(parents=True, exist_ok=True)
    (dropin / "rehearsal.conf").write_text("[Timer]\nOnBootSec=\nOnActiveSec=5s\nAccuracySec=1s\n")
    host.sh("systemctl daemon-reload && systemctl restart coop-deadline.timer")
    host.wait_powered_off(120)


def rehearsal_plan(replay_table: list[str]) -> str:
    """plans/local.toml with the [replay] table that `coop reference-home snapshot` printed: the CPU reference-home
    plan, every other rule and count the local plan's."""
    text = (ROOT / "plans" / "local.toml").read_text()
    text, renamed = re.subn(r'^name = "local"$', 'name = "rehearsal"', text, flags=re.M)
    text, replaced = re.subn(r"^\[replay\]\n(?:.+\n)*", "\n".join(replay_table) + "\n", text, flags=re.M)
    if (renamed, replaced) != (1, 1):
        raise RuntimeError("plans/local.toml no longer has one name and one [replay] table")
    return text


class Run:
    """The experiment as the operator sees it over the API, failing fast once it cannot go on."""

    def __init__(self, api: Api, experiment_id: str) -> None:
        self.api, self.id = api, experiment_id

    def state(self) -> str | None:
        return (self.api.get(f"/api/experiments/{self.id}") or {}).get("state")

    def jobs(self) -> list[dict[str, Any]]:
        experiment = self.api.get(f"/api/experiments/{self.id}") or {}
        if experiment.get("state") in {"failed", "halted"}:
            raise RuntimeError(f"the experiment {experiment['state']}")
        jobs: list[dict[str, Any]] = self.api.get(f"/api/experiments/{self.id}/jobs") or []
        ended = [f"{j['kind']} {j['arm'] or ''} {j['state']}" for j in jobs if j["state"] in {"failed", "cancelled"}]
        if ended:
            raise RuntimeError(f"job(s) ended without success: {', '.join(ended)}")
        return jobs

    def mid_training(self, arms: tuple[str, ...], past: int, seconds: float) -> tuple[dict[str, Any], str]:
        """A train job of ``arms`` whose current rank-0 attempt has reported update ``past`` or later, and the name
        of the host that runs that rank."""
        found: list[tuple[dict[str, Any], str]] = []

        def reached() -> bool:
            for job in self.jobs():
                if job["kind"] != "train" or job["arm"] not in arms or job["state"] != "running":
                    continue
                for attempt in self.api.get(f"/api/jobs/{job['id']}/attempts") or []:
                    if attempt["number"] != job["attempts_made"] or attempt["rank"] != 0:
                        continue
                    steps = (self.api.get(f"/api/attempts/{attempt['id']}/events?kind=step") or {}).get("items", [])
                    if steps and int(steps[-1]["body"]["done"]) >= past:
                        found.append((job, self.host_of(attempt)))
                        return True
            return False

        wait(reached, seconds, f"a train job of {', '.join(arms)} past update {past}", every=0.3)
        return found[0]

    def host_of(self, attempt: dict[str, Any]) -> str:
        return next(name for name, agent in self.api.agents().items() if agent["id"] == attempt["agent_id"])

    def resumed(self, job: dict[str, Any], seconds: float) -> str:
        """Wait for the job to succeed; then what its attempts say: the generations before it ended without a
        result, and each rank of the last resumed from a checkpoint. Returns that as one line."""
        wait(lambda: any(j["id"] == job["id"] and j["state"] == "succeeded" for j in self.jobs()), seconds,
             f"{job['kind']} {job['arm']} to succeed")  # fmt: skip
        done = self.api.get(f"/api/jobs/{job['id']}")
        attempts = self.api.get(f"/api/jobs/{job['id']}/attempts")
        before = sorted({a["state"] for a in attempts if a["number"] < done["attempts_made"]})
        last = [a for a in attempts if a["number"] == done["attempts_made"]]
        steps = {}
        for attempt in last:
            started = self.api.get(f"/api/attempts/{attempt['id']}/events?kind=started")["items"]
            steps[f"rank {attempt['rank']} on {self.host_of(attempt)}"] = started[0]["body"]["resumed_from_step"]
        if not before or "succeeded" in before or not all(step > 0 for step in steps.values()):
            raise RuntimeError(f"{job['arm']}: attempts before the last {before}, the last resumed from {steps}")
        return f"{job['arm']}: attempt {done['attempts_made']} after {', '.join(before)}; resumed from {steps}"


def rehearse(rehearsal: Rehearsal, stage: Stage) -> None:
    """Three booted hosts, the runbook from the install to the recomputed report, a power-off and a restart."""
    blocks = runbook_blocks(RUNBOOK.read_text())
    base, wheels, topology = prepare(rehearsal, stage)
    work = stage.work
    with rehearsal.step("npm cache") as detail:
        npm = npm_cache()
        detail.append(f"package-lock.json's packages in {npm}")
    address = topology["coordinator_address"]
    with rehearsal.step("runbook: ca and coordinator-certificate") as detail:
        tls = certificates(blocks, work / "tls", address)
        detail.append(f"a CA and the coordinator's certificate for {address}")
    api = Api(f"https://{address}:8443", tls["ca"])
    coordinator = Host("coordinator", topology["coordinator_namespace"], work / "coordinator")
    gpus = [Host(spec["name"], spec["namespace"], work / spec["name"]) for spec in topology["hosts"]]
    stage.hosts += [coordinator, *gpus]
    secrets = {host.name: work / "secrets" / host.name for host in stage.hosts}
    for folder in secrets.values():
        folder.mkdir(parents=True)
    shutil.copyfile(tls["key"], secrets["coordinator"] / "coordinator.key")
    shutil.copyfile(tls["cert"], secrets["coordinator"] / "coordinator.pem")
    binds = {host.name: {ROOT: "/srv/coop-repo", wheels: "/srv/wheelhouse", secrets[host.name]: "/srv/secrets"}
             for host in stage.hosts}  # fmt: skip
    binds["coordinator"].update(NODE)
    with rehearsal.step("boot the coordinator, host-a and host-b") as detail:
        for host in stage.hosts:
            host.boot(base, binds[host.name])
        detail.append(", ".join(f"{h.name} {h.sh('systemctl is-system-running').stdout.strip()}" for h in stage.hosts))
    with rehearsal.step("prerequisites: Node.js and npm on the coordinator") as detail:
        coordinator.sh("ln -sf ../lib/node_modules/npm/bin/npm-cli.js /usr/local/bin/npm")
        shutil.copytree(npm, coordinator.merged / "root" / ".npm", dirs_exist_ok=True)
        detail.append("node " + " and npm ".join(coordinator.sh("node --version && npm --version").stdout.split()))
    with rehearsal.step("runbook: host-setup on the three hosts"):
        for host in stage.hosts:
            host.sh(blocks["host-setup"])
    with rehearsal.step("runbook: install-coordinator and install-host, the three hosts at once") as detail:
        installs = [(coordinator, "install-coordinator", {**PIP, "npm_config_offline": "true"})]
        installs += [(host, "install-host", PIP) for host in gpus]
        with ThreadPoolExecutor(len(installs)) as pool:
            for future in [pool.submit(h.sh, blocks[name], env=env, timeout=2400) for h, name, env in installs]:
                future.result()
        version = "import torch; print(torch.__version__)"
        detail.append(f"torch {gpus[0].sh(f'/opt/coop/.venv/bin/python -c {version!r}').stdout.strip()}")
    with rehearsal.step("runbook: coordinator-secrets and coordinator-unit") as detail:
        coordinator.sh(blocks["coordinator-secrets"], cwd="/srv/secrets")
        environment = f"COOP_HOME=/var/lib/coop/coordinator\nCOOP_PUBLIC_ADDRESS={address}\n"
        (coordinator.merged / "etc" / "coop" / "coordinator.env").write_text(environment)
        coordinator.sh(blocks["coordinator-unit"], cwd="/opt/coop")
        wait(lambda: api.get("/health") is not None, 180, "the coordinator's unit to answer over TLS")
        rehearsal.unit_users["coordinator"] = main_process_user(coordinator, "coop-coordinator")
        detail.append(f"{api.url} answers; its unit's process runs as {rehearsal.unit_users['coordinator']}")
    operator = work / "operator"
    with rehearsal.step("runbook: tokens") as detail:
        coordinator.sh(blocks["tokens"], cwd="/opt/coop")
        made = coordinator.merged / "root" / "coop-tokens"
        for host in gpus:
            shutil.copyfile(made / f"{host.name}.token", secrets[host.name] / "agent.token")
            shutil.copyfile(tls["ca"], secrets[host.name] / "ca.pem")
        (operator / "plans").mkdir(parents=True)
        shutil.copyfile(made / "operator.token", operator / "operator.token")
        shutil.copyfile(tls["ca"], operator / "ca.pem")
        (operator / ".venv").symlink_to(ROOT / ".venv")
        api.token = (operator / "operator.token").read_text().strip()
        detail.append(", ".join(sorted(path.name for path in made.iterdir())))
    with rehearsal.step("runbook: agent-secrets on host-a and host-b"):
        for host in gpus:
            host.sh(blocks["agent-secrets"], cwd="/srv/secrets")
    with rehearsal.step("stage the seed and the reference home on host-a and host-b"):
        for host in gpus:
            host.sh(STAGE)
    with rehearsal.step("runbook: reference-home") as detail:
        printed = [json.loads(h.sh(blocks["reference-home"], cwd="/opt/coop").stdout.splitlines()[-1]) for h in gpus]
        if printed[0]["sha256"] != printed[1]["sha256"]:
            raise RuntimeError(f"the hosts' reference homes differ: {[p['sha256'] for p in printed]}")
        plan = rehearsal_plan(printed[0]["toml"])
        for host in gpus:
            (host.merged / PLAN.lstrip("/")).write_text(plan)
        (operator / "plans" / "reference.toml").write_text(plan)
        detail.append(f"both hosts print {printed[0]['sha256']}; recorded in {PLAN}")
    with rehearsal.step("runbook: agent-unit on host-a and host-b") as detail:
        for host, spec in zip(gpus, topology["hosts"], strict=True):
            (host.merged / "etc" / "coop" / "agent.env").write_text(agent_env(api.url, spec, PLAN))
            host.sh(blocks["agent-unit"], cwd="/opt/coop")
        wait(lambda: {h.name for h in gpus} <= set(api.agents()), 240, "both agents to register")
        for host in gpus:
            rehearsal.unit_users[host.name] = main_process_user(host, "coop-agent")
        detail.append(f"both registered; their units' processes run as {rehearsal.unit_users}")
    environment = {**os.environ, "COOP_COORDINATOR": api.url}
    with rehearsal.step("runbook: canary") as detail:
        tried = run(["/bin/sh", "-ec", blocks["canary"]], cwd=operator, env=environment)
        experiment = Run(api, json.loads(tried.stdout.splitlines()[0])["experiment"])
        environment["ID"] = experiment.id
        detail.append(next(line for line in tried.stdout.splitlines() if line.startswith("canary ")))
    with rehearsal.step("runbook: commit") as detail:
        run(["/bin/sh", "-ec", blocks["commit"]], cwd=operator, env=environment)
        log = (operator / "watch.log").open("ab")
        stage.processes.append(subprocess.Popen(["/bin/sh", "-ec", blocks["watch"]], cwd=operator, env=environment,
                                                stdout=log, stderr=log))  # fmt: skip
        detail.append(f"experiment {experiment.id}, followed by the watch in {operator / 'watch.log'}")
    hosts = {host.name: host for host in gpus}
    with rehearsal.step("a host powered off in the middle of a single's training resumes it") as detail:
        job, name = experiment.mid_training(SINGLES, 66, 1200)
        detail.append(f"{name} powered off during {job['arm']}: {power_cycle(hosts[name], base, binds[name], api)}")
        detail.append(experiment.resumed(job, 600))
    with rehearsal.step("systemctl restart coop-agent in the middle of the pair's training resumes the gang") as detail:
        job, name = experiment.mid_training((PAIR,), 66, 900)
        hosts[name].sh("systemctl restart coop-agent")
        detail.append(f"{name}'s agent restarted; {experiment.resumed(job, 600)}")
    with rehearsal.step("the plan runs to its report") as detail:
        wait(lambda: experiment.jobs() and experiment.state() in FINAL, 1800, "the report")
        state = api.get(f"/api/experiments/{experiment.id}")["state"]
        if state != "reported":
            raise RuntimeError(f"the experiment ended {state}")
        detail.append("reported")
    with rehearsal.step("runbook: recompute") as detail:
        run(["/bin/sh", "-ec", blocks["recompute"]], cwd=operator, env=environment)
        recomputed = json.loads((operator / "report.json").read_text())
        recorded = api.get(f"/api/experiments/{experiment.id}/report")
        # The exported ledger also holds the report's own entry, which the report it records could not count.
        if {**recomputed, "ledger_entries": recomputed["ledger_entries"] - 1} != recorded:
            raise RuntimeError("the report recomputed from the evidence differs from the coordinator's")
        faults = {
            arm: [f"{f['updates_recomputed']} updates again from {f['resumed_from_step']}" for f in entry["faults"]]
            for arm, entry in recomputed["training"].items()
        }
        verdict = "PASSED" if recomputed["primary"]["verdict"]["passed"] else "NOT PASSED"
        detail.append(f"the recomputed report is the coordinator's ({verdict}); the faults it counts: {faults}")
    with rehearsal.step("the deadline timer powers host-a off") as detail:
        deadline_timer(gpus[0], blocks)
        detail.append("powered off by coop-deadline.service")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--guard", action="store_true", help="one booted host only: what make test runs")
    parser.add_argument("--out", type=Path, help="write the steps and the verdict here (JSON)")
    parser.add_argument("--keep", action="store_true", help="leave the hosts' folders for a look afterwards")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("rehearse: booting hosts needs root", file=sys.stderr)
        return 2
    tools = ("debootstrap", "systemd-nspawn", "nsenter", "openssl", *(() if args.guard else ("npm",)))
    missing = [tool for tool in tools if not shutil.which(tool)]
    if missing:
        print(f"rehearse: {', '.join(missing)} missing: apt-get install debootstrap systemd-container "
              "util-linux openssl nodejs npm", file=sys.stderr)  # fmt: skip
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped rehearsal still powers its hosts off
    rehearsal = Rehearsal()
    stage = Stage(Path(tempfile.mkdtemp(prefix="coop-rehearsal-")), f"coop-rh-{os.getpid()}")
    started = time.monotonic()
    failed = None
    try:
        (rehearse_guard if args.guard else rehearse)(rehearsal, stage)
    except Exception as exc:
        failed = rehearsal.steps[-1].name if rehearsal.steps else "start"
        print(f"rehearse: step {failed!r} failed: {exc}", file=sys.stderr)
        for host in stage.hosts:
            if host.leader:
                print(f"--- the journal of {host.name}\n{host.journal()}", file=sys.stderr)
    finally:
        for process in stage.processes:
            process.terminate()
        for host in stage.hosts:
            host.stop()
        for process in stage.processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
        subprocess.run([*NAMESPACES, "down", "--prefix", stage.prefix], capture_output=True)
        if not args.keep:
            shutil.rmtree(stage.work, ignore_errors=True)
    verdict = {"rehearsal": "guard" if args.guard else "whole", "passed": failed is None, "failed_step": failed,
               "seconds": round(time.monotonic() - started, 1), "unit_users": rehearsal.unit_users,
               "steps": [asdict(step) | {"seconds": round(step.seconds, 1)} for step in rehearsal.steps]}  # fmt: skip
    print(json.dumps({"verdict": verdict["passed"], "seconds": verdict["seconds"], "failed_step": failed}))
    if args.out:
        args.out.write_text(json.dumps(verdict, indent=2) + "\n")
    return 0 if failed is None else 1


if __name__ == "__main__":
    sys.exit(main())
