"""A host whose GPU a replica holds claims no job that computes on it: vLLM has reserved 90% of its memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from agent.loop import Agent, Settings
from agent.services import Replica
from agent.spool import Spool
from experiment import wire


def _agent(tmp_path: Path, kinds: tuple[str, ...] = ()) -> Agent:
    settings = Settings(
        coordinator="http://127.0.0.1:1",
        token="unused",
        name="a",
        advertise_address="127.0.0.1",
        work_dir=tmp_path,
        model_dir=tmp_path,
        plans_dir=tmp_path,
        kinds=kinds,
    )
    return Agent(settings, cast(Any, None), Spool(tmp_path / "spool.sqlite3"))


def test_a_host_holding_a_replica_claims_every_kind_but_the_accelerators(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    assert agent.claimable() == list(wire.SPECS)
    agent.services._replicas["experiment"] = Replica("m", "http://r", "http://p", cast(Any, ()), None)
    assert agent.services.holds_replica()
    claimed = agent.claimable()
    assert set(claimed) == set(wire.SPECS) - {"train", "evaluate"}
    assert "replica-stop" in claimed and "benchmark" in claimed
    agent.services._replicas.clear()
    assert agent.claimable() == list(wire.SPECS)


def test_an_agent_limited_to_accelerator_kinds_claims_nothing_while_a_replica_runs(tmp_path: Path) -> None:
    agent = _agent(tmp_path, kinds=("train", "evaluate", "replica-stop"))
    assert agent.claimable() == ["train", "evaluate", "replica-stop"]
    agent.services._replicas["experiment"] = Replica("m", "http://r", "http://p", cast(Any, ()), None)
    assert agent.claimable() == ["replica-stop"]
