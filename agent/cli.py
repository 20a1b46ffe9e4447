"""The ``coop-agent`` command: ``coop-agent run --coordinator URL --token-file FILE --name NAME ...``.

The agent token comes from a file or the environment, never from argv, which any user of the host can read
(``ps``, /proc/PID/cmdline)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from agent import jobs, loop
from experiment.core import hostchecks, mounts, secretfile
from experiment.core.errors import CoopError

TOKEN_VARIABLE = "COOP_AGENT_TOKEN"


def read_token(token_file: Path | None) -> str:
    """The agent token from ``token_file`` (which must belong to this user and be private to it) or else the
    environment. The variable is removed from this process's environment, so that the commands the agent starts do
    not inherit it."""
    from_environment = os.environ.pop(TOKEN_VARIABLE, "").strip()
    if token_file is None:
        if not from_environment:
            raise CoopError(f"an agent token is needed: give --token-file FILE or set {TOKEN_VARIABLE}")
        return from_environment
    try:
        token = secretfile.read(token_file, "token file").decode().strip()
    except UnicodeDecodeError as exc:
        raise CoopError(f"the token file {token_file} is not text: {exc}") from None
    if not token:
        raise CoopError(f"the token file {token_file} is empty")
    return token


def _host_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say where this host's coordinator, token, links and folders are: ``run``'s and ``doctor``'s."""
    parser.add_argument(
        "--coordinator",
        required=True,
        help="the coordinator's base URL: https://HOST:PORT, or http:// on loopback only (e.g. http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--ca-file", type=Path, help="the PEM CA that an https coordinator's certificate must verify against"
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help=f"a file holding the agent token, this user's alone, mode 0600 (else {TOKEN_VARIABLE})",
    )
    parser.add_argument("--private-interface", help="the private link's interface, which a gang's collectives use")
    parser.add_argument("--private-address", help="this host's IP address on --private-interface, where gangs meet")
    parser.add_argument("--work-dir", type=Path, required=True, help="homes, logs and the spool live here")
    parser.add_argument("--model-dir", type=Path, default=jobs.ROOT / "seeds" / "tiny", help="the seed model folder")
    parser.add_argument(
        "--reference-home",
        type=Path,
        help="the previous reference run's replay and retention files (a plan whose replay source is reference-home)",
    )
    parser.add_argument(
        "--ephemeral-mount",
        type=Path,
        action="append",
        default=[],
        help="a mount that a stop of the host erases (the instance store's /opt/dlami/nvme is known); the work, "
        "model and reference-home folders may not live on one",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coop-agent", description="The coop worker: runs coordinator jobs here.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="register, then claim and run jobs until stopped (TERM or Ctrl-C)")
    _host_arguments(run)
    # Taken only to refuse it by name: unknown, it would be read as an abbreviation of --token-file.
    run.add_argument("--token", help=argparse.SUPPRESS)
    run.add_argument("--name", required=True, help="this host's name, as shown by the coordinator")
    run.add_argument("--advertise-address", required=True, help="the address other hosts reach this one at")
    run.add_argument(
        "--plans-dir", type=Path, default=jobs.ROOT / "plans", help="where a plan's relative replay folder lies"
    )
    run.add_argument("--heartbeat-seconds", type=float, default=10.0)
    run.add_argument("--claim-wait-seconds", type=float, default=20.0, help="long poll of each claim")
    run.add_argument("--batch-seconds", type=float, default=1.0, help="the longest an event waits to be sent")
    run.add_argument("--grace-seconds", type=float, default=30.0, help="TERM to KILL when no deadline is given")
    run.add_argument(
        "--kind",
        action="append",
        default=[],
        choices=sorted(jobs.HANDLERS),
        help="only these kinds",
    )
    doctor = commands.add_parser(
        "doctor",
        help="check this host before the agent runs: one line a check, each failure with its fix; exit 2 on any",
    )
    _host_arguments(doctor)
    doctor.add_argument(
        "--plan", type=Path, help="the plan to be committed: checks GPU memory, disk, the seed and the reference home"
    )
    doctor.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="the plan's device (default: cuda where nvidia-smi is on PATH)",
    )
    return parser


def _doctor(args: argparse.Namespace) -> int:
    from agent import doctor

    host = doctor.Host(
        coordinator=args.coordinator,
        ca_file=args.ca_file,
        token_file=args.token_file,
        work_dir=args.work_dir.resolve(),
        model_dir=args.model_dir.resolve(),
        reference_home=args.reference_home.resolve() if args.reference_home else None,
        private_interface=args.private_interface,
        private_address=args.private_address,
        ephemeral=tuple(args.ephemeral_mount),
        plan_path=args.plan,
        device=args.device or doctor.default_device(),
    )
    return hostchecks.report(doctor.findings(host, dict(os.environ)), sys.stdout)


def _private_link(args: argparse.Namespace) -> jobs.PrivateLink | None:
    if args.private_interface is None:
        return None
    return jobs.PrivateLink(args.private_interface, args.private_address)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        sys.exit(_doctor(args))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coop-agent %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the log
    if args.token is not None:
        print(
            f"coop-agent: --token is refused (any user can read a command line); use --token-file or {TOKEN_VARIABLE}",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        token = read_token(args.token_file)
    except CoopError as exc:
        print(f"coop-agent: {exc}", file=sys.stderr)
        sys.exit(2)
    if (args.private_interface is None) != (args.private_address is None):
        print("coop-agent: give --private-interface and --private-address together, or neither", file=sys.stderr)
        sys.exit(2)
    durable = {"work folder": args.work_dir, "seed folder": args.model_dir}
    if args.reference_home is not None:
        durable["reference home"] = args.reference_home
    on_ephemeral = mounts.ephemeral_folders(durable, (*mounts.KNOWN_EPHEMERAL, *args.ephemeral_mount), mounts.read())
    if on_ephemeral:
        print("\n".join(f"coop-agent: {line}" for line in on_ephemeral), file=sys.stderr)
        sys.exit(2)
    settings = loop.Settings(
        coordinator=args.coordinator,
        token=token,
        name=args.name,
        advertise_address=args.advertise_address,
        work_dir=args.work_dir.resolve(),
        model_dir=args.model_dir.resolve(),
        plans_dir=args.plans_dir.resolve(),
        reference_home=args.reference_home.resolve() if args.reference_home else None,
        heartbeat_seconds=args.heartbeat_seconds,
        claim_wait_seconds=args.claim_wait_seconds,
        batch_seconds=args.batch_seconds,
        grace_seconds=args.grace_seconds,
        kinds=tuple(args.kind),
        private=_private_link(args),
        ca_file=args.ca_file,
    )
    try:
        loop.run(settings)
    except CoopError as exc:
        print(f"coop-agent: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0)
