"""The units in deploy/ as systemd reads them: each command line, its ${VARIABLES} filled in as the runbook's env files
fill them, parses with the command's own parser; the agent's doctor checks the very folders, token, CA and links that
its run uses; every folder that must survive a stop is on the durable volume, which the agent's own start check
accepts on a g6e (the instance store at /opt/dlami/nvme, an EBS volume at /var/lib/coop); and both run as coop."""

from __future__ import annotations

import shlex
from pathlib import Path

from agent import cli as agent_cli
from experiment.core import mounts
from server import cli as server_cli
from tests.support import ROOT

AGENT_ENV = {
    "COOP_COORDINATOR": "https://10.0.0.10:8443",
    "COOP_NAME": "host-a",
    "COOP_PUBLIC_ADDRESS": "10.0.1.11",
    "COOP_PRIVATE_INTERFACE": "ens6",
    "COOP_PRIVATE_ADDRESS": "10.0.2.11",
    "COOP_SEED_DIR": "/var/lib/coop/seed/SmolLM2-1.7B-Instruct",
    "COOP_PLAN": "/opt/coop/plans/reference.toml",
}
G6E_MOUNTS = mounts.parse(
    "/dev/root / ext4 rw 0 0\n/dev/nvme2n1 /var/lib/coop ext4 rw 0 0\n/dev/nvme1n1 /opt/dlami/nvme ext4 rw 0 0\n"
)


def _unit(name: str) -> dict[str, list[str]]:
    """Key -> its values, in order, with backslash-continued lines joined (systemd's own reading)."""
    joined = (ROOT / "deploy" / name).read_text().replace("\\\n", " ")
    entries: dict[str, list[str]] = {}
    for line in joined.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            entries.setdefault(key, []).append(value)
    return entries


def _argv(command: str, environment: dict[str, str]) -> list[str]:
    for name, value in environment.items():
        command = command.replace("${" + name + "}", value)
    assert "${" not in command, command
    return shlex.split(command)


def test_the_agent_unit_checks_with_its_doctor_what_its_run_uses() -> None:
    unit = _unit("coop-agent.service")
    assert unit["User"] == ["coop"] and unit["RequiresMountsFor"] == ["/var/lib/coop"]
    [pre], [start] = unit["ExecStartPre"], unit["ExecStart"]
    doctor_argv, run_argv = _argv(pre, AGENT_ENV), _argv(start, AGENT_ENV)
    assert doctor_argv[:2] == ["/opt/coop/.venv/bin/coop-agent", "doctor"]
    assert run_argv[:2] == ["/opt/coop/.venv/bin/coop-agent", "run"]
    doctor = vars(agent_cli.build_parser().parse_args(doctor_argv[1:]))
    run = vars(agent_cli.build_parser().parse_args(run_argv[1:]))
    shared = {key for key in doctor if key in run and key != "command"}
    assert shared == {
        "coordinator", "ca_file", "token_file", "private_interface", "private_address", "work_dir", "model_dir",
        "reference_home", "ephemeral_mount",
    }  # fmt: skip
    assert {key: doctor[key] for key in shared} == {key: run[key] for key in shared}
    assert doctor["plan"] == Path("/opt/coop/plans/reference.toml")
    durable = {"work folder": run["work_dir"], "seed folder": run["model_dir"], "reference home": run["reference_home"]}
    assert mounts.ephemeral_folders(durable, mounts.KNOWN_EPHEMERAL, G6E_MOUNTS) == []


def test_the_coordinator_unit_runs_its_doctor_then_migrates_then_serves_as_coop() -> None:
    unit = _unit("coop-coordinator.service")
    assert unit["User"] == ["coop"] and unit["RequiresMountsFor"] == ["/var/lib/coop"]
    environment = {"COOP_PUBLIC_ADDRESS": "10.0.0.10"}
    commands = [_argv(command, environment) for command in (*unit["ExecStartPre"], *unit["ExecStart"])]
    parsed = [server_cli._parser().parse_args(argv[1:]) for argv in commands]
    assert [args.command for args in parsed] == ["doctor", "migrate", "serve"]
    doctor, serve = parsed[0], parsed[2]
    assert (doctor.certfile, doctor.keyfile) == (serve.certfile, serve.keyfile) != (None, None)


def test_every_coop_service_writes_files_for_its_own_user_alone() -> None:
    units = [unit.name for unit in sorted((ROOT / "deploy").glob("*.service")) if _unit(unit.name).get("User")]
    assert units == ["coop-agent.service", "coop-coordinator.service"]
    for name in units:
        assert _unit(name).get("UMask") == ["0077"], f"{name} sets no UMask=0077"
