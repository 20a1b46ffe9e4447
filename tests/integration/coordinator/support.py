"""The coordinator app in-process for its tests: an operator's view of it (Api), with fake agents that reach
it through the real agent client."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from litestar.testing import TestClient
from litestar.testing.transport import TestClientTransport

from server.app import create_app
from server.settings import Settings
from tests.support.agent import FakeAgent
from tests.support.database import make_token
from tests.support.scenarios import bearer, create_experiment


class Api:
    """The coordinator as a client sees it: the operator's token and raw requests at hand, and registered fake
    agents by name."""

    def __init__(self, client: TestClient[Any], url: str, home: Path | None = None) -> None:
        self.client = client
        self.url = url
        self.home = home
        self.operator = make_token(url, "operator", "operator")
        self.agents: dict[str, FakeAgent] = {}

    @property
    def http(self) -> httpx.Client:
        return self.client

    def agent(self, name: str, address: str | None = None) -> FakeAgent:
        """A registered agent, whose requests reach this app through the real agent client."""
        agent = FakeAgent(
            str(self.client.base_url),
            make_token(self.url, "agent", name),
            transport=TestClientTransport(self.client),  # type: ignore[arg-type]
        )
        agent.register(address or f"{name}.hosts.test")
        self.agents[name] = agent
        return agent

    def create_experiment(self, commit: bool = True) -> dict[str, Any]:
        return create_experiment(self, commit=commit)

    def get(self, path: str) -> Any:
        response = self.client.get(path)
        assert response.status_code == 200, response.text
        return response.json()

    def operator_post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """The operator's POST, whatever the coordinator answers (for tests of its refusals)."""
        return self.client.post(path, json=body, headers=bearer(self.operator))


@contextmanager
def running(settings: Settings) -> Iterator[TestClient[Any]]:
    with TestClient(create_app(settings)) as client:
        yield client
