"""The roles a bearer token holds: what each may do is declared by the routes (server.access.auth, server.api.spec)."""

from __future__ import annotations

from typing import Literal

# operator: runs experiments (every operator write and read); agent: claims and reports jobs; reader: reads every
# route, page and /metrics, and writes nothing, for analysts and scrapes.
Role = Literal["operator", "agent", "reader"]
ROLES: tuple[Role, ...] = ("operator", "agent", "reader")
