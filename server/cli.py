"""The ``coop-server`` command: migrate, serve, tokens, ledger verification, backup and restore, and an operator's
or analyst's experiment commands over the REST API. Each command imports its own parts when it runs, so that
``--help`` and a refused argument answer at once."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import ssl
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from experiment.core.errors import CoopError
from experiment.core.states import ExperimentState
from server.access.roles import ROLES
from server.settings import Settings, from_env

if TYPE_CHECKING:
    from server import operator


def _prepare_home(settings: Settings) -> None:
    """The home, made if the database lives in it, and kept private: it holds the home's secret and the blobs."""
    from server import db

    if db.is_sqlite(settings.database_url):
        settings.home.mkdir(mode=0o700, parents=True, exist_ok=True)
    if settings.home.is_dir():
        _private(settings.home, 0o700, "the coordinator's home")


def _private(path: Path, mode: int, what: str) -> None:
    """Give ``path`` this user's ``mode`` if it is open to anyone else, and say so on stderr."""
    before = path.stat().st_mode & 0o777
    if before & 0o077:
        path.chmod(mode)
        print(f"made {what} {path} private: mode {before:04o} -> {mode:04o}", file=sys.stderr)


def _private_database(settings: Settings) -> None:
    """A SQLite database's files (they hold the tokens' hashes, the audit log and every result) readable by this
    user alone. SQLite makes the -wal and -shm files with the database file's mode; those already there are fixed
    too."""
    from sqlalchemy.engine import make_url

    from server import db

    if not db.is_sqlite(settings.database_url):
        return
    database = Path(make_url(settings.database_url).database or "")
    for path in (database, database.with_name(f"{database.name}-wal"), database.with_name(f"{database.name}-shm")):
        if path.is_file():
            _private(path, 0o600, "the database file")


async def _create_token(settings: Settings, role: str, name: str) -> str:
    from server import db
    from server.access import tokens

    await db.require_migrated(settings.database_url)
    engine = db.create_engine(settings.database_url)
    try:
        async with db.session_maker(engine)() as session, session.begin():
            return await tokens.create(session, role, name)
    finally:
        await engine.dispose()


async def _revoke_token(settings: Settings, name: str) -> None:
    from server import db
    from server.access import tokens

    await db.require_migrated(settings.database_url)
    engine = db.create_engine(settings.database_url)
    try:
        async with db.session_maker(engine)() as session, session.begin():
            await tokens.revoke(session, name)
    finally:
        await engine.dispose()


async def _verify(settings: Settings, experiment_id: uuid.UUID) -> int:
    from experiment.core.ledger import verify_ledger
    from server import db
    from server.store import commitments

    await db.require_migrated(settings.database_url)
    engine = db.create_engine(settings.database_url)
    try:
        async with db.session_maker(engine)() as session:
            entries = await commitments.entries(session, experiment_id)
    finally:
        await engine.dispose()
    if not entries:
        raise CoopError(f"experiment {experiment_id} has no commitments (is the id right?)")
    verify_ledger(entries)
    return len(entries)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coop-server", description="The coop coordinator.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("migrate", help="upgrade the database to the newest schema")
    serve = commands.add_parser("serve", help="run the HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--migrate", action="store_true", help="upgrade the database first")
    serve.add_argument("--certfile", type=Path, help="serve HTTPS with this PEM certificate (with --keyfile)")
    serve.add_argument("--keyfile", type=Path, help="the PEM private key of --certfile, unencrypted")
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="log every request on stderr (off by default: it costs about a tenth of a heartbeat's CPU)",
    )
    doctor = commands.add_parser(
        "doctor",
        help="check this host before the coordinator starts (COOP_* settings, TLS files): one line a check, exit 2 "
        "on any failure",
    )
    doctor.add_argument("--certfile", type=Path, help="the PEM certificate serve will use")
    doctor.add_argument("--keyfile", type=Path, help="its private key, which must be this user's alone")
    doctor.add_argument(
        "--ephemeral-mount",
        type=Path,
        action="append",
        default=[],
        help="a mount that a stop of the host erases (the instance store's /opt/dlami/nvme is known)",
    )
    token = commands.add_parser("token", help="manage bearer tokens").add_subparsers(dest="action", required=True)
    create = token.add_parser("create", help="create a token and print it once")
    create.add_argument(
        "--role", choices=ROLES, required=True, help="operator: runs experiments; agent: a host; reader: reads only"
    )
    create.add_argument("--name", required=True)
    revoke = token.add_parser("revoke", help="revoke a token by name")
    revoke.add_argument("--name", required=True)
    verify = commands.add_parser("verify-ledger", help="verify an experiment's commitment chain")
    verify.add_argument("experiment_id", type=uuid.UUID)
    backup = commands.add_parser(
        "backup",
        help="copy the database, the blob store and the home's secret into one tar, while the coordinator runs",
    )
    backup.add_argument("--out", type=Path, required=True, metavar="FILE", help="the tar to write (never overwritten)")
    restore = commands.add_parser(
        "restore", help="restore a backup into an empty COOP_HOME (and, on Postgres, an empty database)"
    )
    restore.add_argument(
        "--from", dest="source", type=Path, required=True, metavar="FILE", help="the tar `backup` wrote"
    )
    _experiment_parser(commands)
    return parser


def _experiment_parser(commands: Any) -> None:
    experiment = commands.add_parser(
        "experiment",
        help="operate an experiment through the coordinator's REST API",
        description="Coordinator URL from --coordinator or COOP_COORDINATOR; token from --token-file or COOP_TOKEN: "
        "an operator's to act, any role's to read (list, show, export) where reads are not public.",
    )
    experiment.add_argument("--coordinator", default=os.environ.get("COOP_COORDINATOR", "http://127.0.0.1:8000"))
    experiment.add_argument("--token-file", type=Path, help="a file holding the token (else COOP_TOKEN)")
    experiment.add_argument(
        "--ca-file",
        type=Path,
        default=os.environ.get("COOP_CA_FILE"),
        help="the PEM CA an https coordinator's certificate must verify against (else COOP_CA_FILE, else the system's)",
    )
    actions = experiment.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create and commit an experiment from a plan")
    create.add_argument("--plan", type=Path, required=True)
    create.add_argument("--no-autopilot", dest="autopilot", action="store_false", help="one advance per phase")
    create.add_argument("--override-canary", metavar="REASON", help=OVERRIDE_HELP)
    canary = actions.add_parser(
        "canary",
        help="try every risky step on the hosts in minutes, before the plan is committed (a draft's canary job)",
        description="With --plan: create a draft of the plan and run its canary; with an experiment id: run the "
        "draft's canary again. Prints each step as a host ends it, then the verdict; exit 1 unless it passed.",
    )
    which = canary.add_mutually_exclusive_group(required=True)
    which.add_argument("--plan", type=Path, help="a plan to create a draft of")
    which.add_argument("experiment_id", nargs="?", type=uuid.UUID, help="a draft whose canary runs again")
    canary.add_argument("--no-autopilot", dest="autopilot", action="store_false", help="(the draft's, once committed)")
    commit = actions.add_parser("commit", help="commit a draft's plan (its canary must have passed on a GPU plan)")
    commit.add_argument("experiment_id", type=uuid.UUID)
    commit.add_argument("--override-canary", metavar="REASON", help=OVERRIDE_HELP)
    actions.add_parser("advance", help="queue the next phase's jobs").add_argument("experiment_id", type=uuid.UUID)
    pilot = actions.add_parser("autopilot", help="switch autopilot on or off")
    pilot.add_argument("experiment_id", type=uuid.UUID)
    pilot.add_argument("switch", choices=("on", "off"))
    follow = actions.add_parser("watch", help="follow an experiment until it ends, then print its verdict")
    follow.add_argument("experiment_id", type=uuid.UUID)
    actions.add_parser("list", help="every experiment: id, state, name, created")
    actions.add_parser("show", help="one experiment, its arms and, once reported, its verdict").add_argument(
        "experiment_id", type=uuid.UUID
    )
    actions.add_parser("halt", help="halt an experiment: none of its jobs is handed out again").add_argument(
        "experiment_id", type=uuid.UUID
    )
    export = actions.add_parser("export", help="download the evidence bundle that `coop report --home` reads")
    export.add_argument("experiment_id", type=uuid.UUID)
    export.add_argument("--out", type=Path, required=True, help="the tar to write (never overwritten)")


OVERRIDE_HELP = (
    "commit a GPU plan whose canary did not pass: the reason, which the plan's commitment in the ledger records"
)
READS = {"list", "show", "export"}  # public reads unless the coordinator's reads are switched off


def _operator(args: argparse.Namespace) -> operator.Operator:
    from server import operator

    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise CoopError(f"cannot read token file {args.token_file}: {exc.strerror}") from exc
    else:
        token = os.environ.get("COOP_TOKEN", "")
    if not token and args.action not in READS:
        raise CoopError(f"`experiment {args.action}` needs an operator token: pass --token-file or set COOP_TOKEN")
    verify: ssl.SSLContext | bool = True
    if args.ca_file is not None:
        try:
            verify = ssl.create_default_context(cafile=str(args.ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise CoopError(f"cannot use the CA file {args.ca_file}: {exc}") from None
    return operator.Operator(args.coordinator, token or None, verify)


def _experiment(args: argparse.Namespace) -> int:
    from server import operator

    client = _operator(args)
    if args.action == "list":
        for line in operator.listing(client.experiments()):
            print(line)
    elif args.action == "show":
        print(msgspec.json.encode(client.experiment(args.experiment_id)).decode())
        for arm in client.arms(args.experiment_id):
            print(msgspec.json.encode(arm).decode())
        if client.experiment(args.experiment_id).state == ExperimentState.REPORTED:
            for line in operator.verdict_lines(client.report(args.experiment_id)):
                print(line)
    elif args.action == "halt":
        print(msgspec.json.encode(client.halt(args.experiment_id)).decode())
    elif args.action == "export":
        size = client.export(args.experiment_id, args.out)
        print(json.dumps({"experiment": str(args.experiment_id), "out": str(args.out), "bytes": size}))
    elif args.action == "create":
        print(msgspec.json.encode(client.create(args.plan, args.autopilot, True, args.override_canary)).decode())
    elif args.action == "commit":
        print(msgspec.json.encode(client.commit(args.experiment_id, args.override_canary)).decode())
    elif args.action == "canary":
        experiment_id = args.experiment_id
        if experiment_id is None:
            experiment_id = client.create(args.plan, args.autopilot, commit=False).id
        canary = operator.run_canary(client, experiment_id)
        for line in operator.canary_lines(canary):
            print(line)
        if not canary.passed:
            return 1
        print(f"commit it with: coop-server experiment commit {experiment_id}")
    elif args.action == "advance":
        print(msgspec.json.encode(client.advance(args.experiment_id)).decode())
    elif args.action == "autopilot":
        print(msgspec.json.encode(client.autopilot(args.experiment_id, args.switch == "on")).decode())
    elif args.action == "watch":
        final = operator.watch(client, args.experiment_id)
        if final.state != ExperimentState.REPORTED:
            print(f"experiment {final.id} ended {final.state}", file=sys.stderr)
            return 1
        for line in operator.verdict_lines(client.report(args.experiment_id)):
            print(line)
    return 0


GRACEFUL_SHUTDOWN_SECONDS = 5


def _serve(args: argparse.Namespace, settings: Settings) -> None:
    from server.access import tls

    if (args.certfile is None) != (args.keyfile is None):
        raise CoopError("TLS needs both --certfile and --keyfile")
    # Checked before anything starts: a wrong file is one message and exit 2, not a traceback from uvicorn.
    certificate = None if args.certfile is None else tls.check(args.certfile, args.keyfile)

    import uvicorn

    from server import migrate
    from server.app import create_app

    if args.migrate:
        migrate.upgrade(settings.database_url)
    _private_database(settings)
    uvicorn.run(
        create_app(dataclasses.replace(settings, tls=certificate is not None)),
        host=args.host,
        port=args.port,
        log_level="info",
        access_log=args.access_log,
        ssl_certfile=None if certificate is None else certificate.certfile,
        ssl_keyfile=None if certificate is None else certificate.keyfile,
        # On TERM uvicorn waits for open connections to close, and over TLS a client's idle keep-alive connection
        # never does: the coordinator hung until it was killed, and a restart outlasted the agents' leases. Requests
        # still running after this long are cut; agents retry them (every upload is idempotent).
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )


def _backup_or_restore(args: argparse.Namespace, settings: Settings) -> int:
    from experiment.core.progress import Events
    from server import backup

    with Events() as events:
        if args.command == "backup":
            backup.backup(settings, args.out, events.emit)
        else:
            backup.restore(settings, args.source, events.emit)
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "experiment":
        return _experiment(args)
    settings = from_env()
    if args.command == "doctor":
        from experiment.core.hostchecks import report
        from server import doctor

        if (args.certfile is None) != (args.keyfile is None):
            raise CoopError("give --certfile and --keyfile together, or neither")
        found = doctor.findings(settings, args.certfile, args.keyfile, tuple(args.ephemeral_mount))
        return report(found, sys.stdout)
    if args.command in {"backup", "restore"}:
        return _backup_or_restore(args, settings)  # before _prepare_home: a restore's home must be left as it is
    if args.command in {"migrate", "serve"}:
        _prepare_home(settings)  # the others refuse a home that migrate has not made, and make nothing
    if args.command == "migrate":
        from server import db, migrate

        migrate.upgrade(settings.database_url)
        _private_database(settings)
        print(json.dumps({"migrated": True, "database": db.describe(settings.database_url)}))
    elif args.command == "serve":
        _serve(args, settings)
    elif args.command == "token" and args.action == "create":
        secret = asyncio.run(_create_token(settings, args.role, args.name))
        print(secret)
        print(f"token {args.name!r} ({args.role}): shown once, store it now", file=sys.stderr)
    elif args.command == "token" and args.action == "revoke":
        asyncio.run(_revoke_token(settings, args.name))
        print(json.dumps({"revoked": args.name}))
    elif args.command == "verify-ledger":
        count = asyncio.run(_verify(settings, args.experiment_id))
        print(json.dumps({"experiment": str(args.experiment_id), "entries": count, "verified": True}))
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    try:
        code = run(argv)
    except CoopError as exc:
        print(f"coop-server: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)
