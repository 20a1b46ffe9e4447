"""Fixtures of the agent tests: a real coordinator per test and agent processes that end with the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from experiment.seed import seedmodel
from tests.integration.agent.support import AgentProcess
from tests.support.processes import QUICK, CoordinatorProcess


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    home = tmp_path / "coordinator"
    home.mkdir()
    server = CoordinatorProcess(home, **QUICK)
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def start_agent(
    coordinator: CoordinatorProcess, tmp_path: Path, small_seed: tuple[Path, seedmodel.Snapshot]
) -> Iterator[Callable[[str], AgentProcess]]:
    agents: list[AgentProcess] = []

    def start(name: str) -> AgentProcess:
        agent = AgentProcess(coordinator, name, tmp_path / name, small_seed[0], coordinator.agent_token(name))
        agent.start()
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.stop()
