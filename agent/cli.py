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
from experiment.core.errors import CoopError

TOKEN_VARIABLE = "COOP_AGENT_TOKEN"


def read_token(token_file: Path | None) -> str:
    """The agent token from ``token_file`` (which must be private to its owner) or else the environment. The variable
    is removed from this process's environment, so that the commands the agent starts do not inherit it."""
    from_environment = os.environ.pop(TOKEN_VARIABLE, "").strip()
    if token_file is None:
        if not from_environment:
            raise CoopError(f"an agent token is needed: give --token-file FILE or set {TOKEN_VARIABLE}")
        return from_environment
    try:
        if token_file.stat().st_mode & 0o077:
            raise CoopError(
                f"the token file {token_file} is readable by others; make it private: chmod 600 {token_file}"
            )
        token = token_file.read_text().strip()
    except FileNotFoundError:
        raise CoopError(f"the token file {token_file} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CoopError(f"cannot read the token file {token_file}: {exc}") from None
    if not token:
        raise CoopError(f"the token file {token_file} is empty")
    return token


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coop-agent", description="The coop worker: runs coordinator jobs here.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="register, then claim and run jobs until stopped (TERM or Ctrl-C)")
    run.add_argument(
        "--coordinator",
        required=True,
        help="the coordinator's base URL: https://HOST:PORT, or http:// on loopback only (e.g. http://127.0.0.1:8000)",
    )
    run.add_argument(
        "--ca-file", type=Path, help="the PEM CA that an https coordinator's certificate must verify against"
    )
    run.add_argument(
        "--token-file", type=Path, help=f"a file holding the agent token, mode 0600 (else {TOKEN_VARIABLE})"
    )
    # Taken only to refuse it by name: unknown, it would be read as an abbreviation of --token-file.
    run.add_argument("--token", help=argparse.SUPPRESS)
    run.add_argument("--name", required=True, help="this host's name, as shown by the coordinator")
    run.add_argument("--advertise-address", required=True, help="the address other hosts reach this one at")
    run.add_argument("--private-interface", help="the private link's interface, which a gang's collectives use")
    run.add_argument("--private-address", help="this host's IP address on --private-interface, where gangs meet")
    run.add_argument("--work-dir", type=Path, required=True, help="homes, logs and the spool live here")
    run.add_argument("--model-dir", type=Path, default=jobs.ROOT / "seeds" / "tiny", help="the seed model folder")
    run.add_argument(
        "--plans-dir", type=Path, default=jobs.ROOT / "plans", help="where a plan's relative replay folder lies"
    )
    run.add_argument(
        "--reference-home",
        type=Path,
        help="the previous reference run's replay and retention files (a plan whose replay source is reference-home)",
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
    return parser


def _private_link(args: argparse.Namespace) -> jobs.PrivateLink | None:
    if args.private_interface is None:
        return None
    return jobs.PrivateLink(args.private_interface, args.private_address)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
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
