"""Every job kind is whole: the wire names it with a spec and a result, the coordinator's table has its entry, an
agent-run kind has the agent's handler, and the handler's command line is one the real `coop` parser takes."""

from __future__ import annotations

import contextlib
import datetime
import threading
import uuid
from pathlib import Path
from typing import Any, get_args

import msgspec
import pytest

from agent import jobs
from experiment import cli, wire
from experiment.core import ledger
from experiment.core.plan import load_plan, plan_identity
from server.protocol import kinds
from tests.support import ROOT

# The kinds whose handler runs no `coop` command: the agent stops the replica it keeps itself (agent/services.py).
RUN_BY_THE_AGENT_ITSELF = {"replica-stop"}
# A spec each kind's handler reads (the kinds not named here take an empty one).
SPECS: dict[str, dict[str, Any]] = {
    "canary": {"plan_toml": (ROOT / "plans" / "local.toml").read_text()},
    "replica-start": {"rank": 0},
    "replica-stop": {"rank": 0},
    "benchmark": {"phase": "single", "endpoints": ["http://127.0.0.1:9001"]},
}


class _Ran(Exception):
    """Raised by the recording host in place of running a command."""


class _Services:
    def stop(self, key: str) -> bool:
        return False


class _Recording:
    """A host that records the first `coop` command a handler runs, and runs none."""

    advertise_address = "127.0.0.1"

    def __init__(self) -> None:
        self.services = _Services()
        self.stopping = threading.Event()
        self.argv: list[str] | None = None

    def command(self, run: jobs.Run[Any], argv: list[str]) -> list[wire.Event]:
        self.argv = argv
        raise _Ran


def _assignment(kind: wire.JobKind) -> wire.Assignment:
    return wire.Assignment(
        job_id=uuid.UUID(int=1),
        attempt_id=uuid.UUID(int=2),
        experiment_id=uuid.UUID(int=3),
        kind=kind,
        arm="clean-pair",
        role="dev" if kind == "evaluate" else None,
        spec=SPECS.get(kind, {}),
        number=0,
        rank=0,
        world_size=1,
        master_addr=None,
        master_port=None,
        lease_token="t" * 32,
        lease_expires_at=datetime.datetime.now(datetime.UTC),
    )


def _command_line(kind: wire.JobKind, tmp_path: Path) -> list[str] | None:
    """The `coop` arguments the kind's handler runs first, or None when it runs no command."""
    plan = load_plan(ROOT / "plans" / "local.toml")
    committed = ledger.next_entry(None, "plan", plan_identity(plan), {"plan": msgspec.to_builtins(plan)})
    handler = jobs.handler(kind)
    job = _assignment(kind)
    ws = jobs.Workspace(root=tmp_path, model_dir=tmp_path / "seed", plans_dir=ROOT / "plans")
    run = jobs.Run(job, handler.read_spec(job), ws, ledger={"plan": committed})
    host = _Recording()
    with contextlib.suppress(_Ran):
        handler.execute(host, run)
    if host.argv is None:
        return None
    assert host.argv[:3] == jobs.coop(), f"a {kind} job runs {host.argv[:3]}, not the `coop` command"
    return host.argv[3:]


def test_the_coordinators_table_has_every_kind_of_the_wire() -> None:
    assert set(kinds.TABLE) == set(get_args(wire.JobKind))
    for name, kind in kinds.TABLE.items():
        assert (kind.spec, kind.result) == (wire.SPECS[name], wire.RESULTS[name]), name


def test_the_agent_handles_exactly_the_kinds_agents_run() -> None:
    assert kinds.BY_AGENTS, "no kind runs on an agent"
    assert set(jobs.HANDLERS) == set(kinds.BY_AGENTS)
    assert not set(jobs.HANDLERS) & set(kinds.BY_COORDINATOR)


@pytest.mark.parametrize("kind", kinds.BY_AGENTS)
def test_an_agent_run_kind_runs_a_coop_command_the_parser_takes(kind: wire.JobKind, tmp_path: Path) -> None:
    argv = _command_line(kind, tmp_path)
    if kind in RUN_BY_THE_AGENT_ITSELF:
        assert argv is None, f"the agent runs {kind} itself, yet its handler runs `coop {' '.join(argv or [])}`"
        return
    assert argv is not None, f"the {kind} handler runs no `coop` command"
    args = cli.build_parser().parse_args(argv)  # an unknown command or argument exits 2 here
    assert args.handler.__module__ == cli.__name__


def test_the_kinds_run_by_the_agent_itself_are_agent_run_kinds() -> None:
    assert set(RUN_BY_THE_AGENT_ITSELF) <= set(kinds.BY_AGENTS)
