"""A fuzzer over the coordinator's own OpenAPI document: schemathesis generates requests for every operation, valid
and invalid, and sends each one to a real `coop-server serve` process per database backend, with an operator token,
an agent token and no token. Any 5xx is a defect: bad input must get a 4xx that says why. Prints one JSON object.

    .venv/bin/python -m tests.fuzz [--examples 25] [--backends sqlite,postgres]

Generating the requests is most of the fuzzer's time, so each generated request goes to every backend's coordinator
(with that coordinator's own ids and lease token where it names rows) rather than being generated again per backend.
The test suite runs it too (tests/integration/coordinator/test_faults.py), with fewer examples.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from server import migrate
from server.settings import sqlite_url
from tests.support import database
from tests.support.agent import FakeAgent
from tests.support.processes import served
from tests.support.scenarios import LOCAL_PLAN, bearer

ROLES = ("operator", "agent", "none")


@dataclass
class Tally:
    """What the fuzzer sent and got back, per token role."""

    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    # The first few 5xx: operation, role, status and the start of the body.
    server_errors: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": sum(self.requests.values()),
            "requests_by_role": self.requests,
            "statuses": {str(code): count for code, count in sorted(self.statuses.items())},
            "server_errors": sum(count for code, count in self.statuses.items() if code >= 500),
            "first_server_errors": self.server_errors,
        }


@dataclass(frozen=True)
class Principals:
    """The base URL, a token of each role (None: no token), and the agent whose token it is."""

    base: str
    tokens: dict[str, str | None]
    agent: FakeAgent

    def headers(self, role: str) -> dict[str, str]:
        token = self.tokens[role]
        return bearer(token) if token else {}


@dataclass(frozen=True)
class Rows:
    """Rows of a fresh experiment: its id, and the attempt the agent claimed and started with its lease token, so
    that operations on those ids reach their handlers' checks (an upload with the attempt's own lease token and
    Idempotency-Key reaches the database), not only their 404s."""

    ids: dict[str, str]
    lease_token: str


def _principals(base: str, database_url: str) -> Principals:
    operator = database.make_token(database_url, "operator", "fuzz-operator")
    token = database.make_token(database_url, "agent", "fuzz-agent")
    agent = FakeAgent(base, token)
    agent.register("127.0.0.1")
    return Principals(base, {"operator": operator, "agent": token, "none": None}, agent)


def _rows(principals: Principals) -> Rows:
    with httpx.Client(base_url=principals.base, timeout=30) as http:
        plan = {"plan_toml": LOCAL_PLAN.read_text()}
        experiment = http.post("/api/experiments", json=plan, headers=principals.headers("operator")).json()
    job = principals.agent.take()
    ids = {"experiment_id": experiment["id"], "job_id": str(job.job_id), "attempt_id": str(job.attempt_id)}
    return Rows(ids, job.lease_token)


def _send(principals: Principals, case: schemathesis.Case, role: str, rows: Rows | None, tally: Tally) -> None:
    """``case`` as ``role`` to one coordinator, whose rows (``rows``) the case's path names where it names any."""
    headers = {**(case.headers or {}), **principals.headers(role)}
    on_attempt = rows is not None and (case.path_parameters or {}).get("attempt_id") == rows.ids["attempt_id"]
    if rows is not None and on_attempt and role == "agent" and isinstance(case.body, dict):
        # The attempt's own lease and key: the fuzzed rest of the body meets the database.
        case.body["lease_token"] = rows.lease_token
        sequence = case.body.get("sequence") if case.operation.path.endswith("/events") else "result"
        headers["Idempotency-Key"] = f"{rows.ids['job_id']}:{rows.ids['attempt_id']}:{sequence}"
    response = case.call(base_url=principals.base, headers=headers, timeout=60)
    tally.requests[role] += 1
    tally.statuses[response.status_code] += 1
    if response.status_code >= 500 and len(tally.server_errors) < 10:
        error = {"operation": case.operation.label, "role": role, "status": response.status_code}
        tally.server_errors.append(error | {"body": response.text[:300]})


def _sender(
    coordinators: dict[str, Principals], role: str, rows: dict[str, Rows] | None, tallies: dict[str, Tally]
) -> Any:
    """Sends a case to every coordinator. A case on rows was generated with the first coordinator's ids: each
    other coordinator gets its own ids where the first's stand."""
    lead = next(iter(coordinators))

    def send(case: schemathesis.Case) -> None:
        generated = dict(case.path_parameters or {})
        for backend, principals in coordinators.items():
            if rows is not None:
                ids = {rows[lead].ids[name]: rows[backend].ids[name] for name in rows[lead].ids}
                case.path_parameters = {name: ids.get(value, value) for name, value in generated.items()}
            _send(principals, case, role, rows[backend] if rows else None, tallies[backend])

    return send


def fuzz(coordinators: dict[str, Principals], examples: int) -> dict[str, Tally]:
    """Every operation, in both generation modes, with each role's token, on random ids and, where it names rows,
    on the ids of a fresh experiment's; each case goes to every coordinator (one a backend), and a 5xx never stops
    it. What each coordinator answered is tallied on its own."""
    lead = next(iter(coordinators.values()))
    schema = schemathesis.openapi.from_url(f"{lead.base}/schema/openapi.json")
    tallies = {backend: Tally() for backend in coordinators}
    budget = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    for result in schema.get_all_operations():
        operation = result.ok()
        names = {parameter.name for parameter in operation.iter_parameters() if parameter.location == "path"}
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for role in ROLES:
                fresh = None
                if names & {"experiment_id", "job_id", "attempt_id"}:
                    fresh = {backend: _rows(principals) for backend, principals in coordinators.items()}
                for rows in [None, fresh] if fresh is not None else [None]:
                    known = None
                    if rows is not None:
                        known = {name: value for name, value in next(iter(rows.values())).ids.items() if name in names}
                    strategy = operation.as_strategy(generation_mode=mode, path_parameters=known)
                    # An operation with nothing to get wrong (no parameters, no body) has no negative case.
                    with contextlib.suppress(Unsatisfiable):
                        budget(given(case=strategy)(_sender(coordinators, role, rows, tallies)))()
    return tallies


def _database(backend: str, home: Path) -> str:
    """A new, migrated database of ``backend`` (sqlite: a file in ``home``)."""
    if backend == "sqlite":
        url = sqlite_url(home / "coordinator.sqlite3")
    else:
        created = database.create_postgres_database(database.postgres_admin_url())
        if created is None:
            raise RuntimeError(f"no Postgres server answers at {database.postgres_admin_url()}")
        url = created
    migrate.upgrade(url)
    return url


def run(backends: Sequence[str], examples: int) -> list[dict[str, Any]]:
    """The fuzzer against one fresh coordinator per backend; one result per backend."""
    with contextlib.ExitStack() as stack:
        coordinators: dict[str, Principals] = {}
        for backend in backends:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"coop-fuzz-{backend}-")))
            url = _database(backend, home)
            if backend == "postgres":
                stack.callback(database.drop_postgres_database, database.postgres_admin_url(), url)
            # Claims long-poll for work at most 1 s here, well inside the client's timeout.
            base = stack.enter_context(served(url, home, COOP_MAX_CLAIM_WAIT_SECONDS="1"))
            coordinators[backend] = _principals(base, url)
            stack.callback(coordinators[backend].agent.close)
        started = time.monotonic()
        tallies = fuzz(coordinators, examples)
        seconds = round(time.monotonic() - started, 1)
    return [{"backend": b, "examples": examples, "seconds": seconds} | t.as_json() for b, t in tallies.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=25, help="examples per operation, mode and role")
    parser.add_argument("--backends", default="sqlite,postgres")
    args = parser.parse_args()
    results = run(args.backends.split(","), args.examples)
    print(json.dumps({"fuzz": results}, indent=2))
    return 1 if any(result["server_errors"] for result in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
