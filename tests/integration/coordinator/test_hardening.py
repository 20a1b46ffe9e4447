"""What a stranger's requests cannot do: hold a whole log in the coordinator's memory, outlive a sign-out with an old
cookie, act with another session's CSRF token or from another site, make the coordinator read a large body under a
bad token, or take it past the decoder's recursion with a deeply nested body."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sqlite3
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import cli
from server.access import tokens
from server.store import bodies, pages, records
from server.web import gate
from tests.integration.coordinator.support import Api
from tests.support.agent import FakeAgent
from tests.support.database import make_token, with_session
from tests.support.scenarios import LOCAL_PLAN, bearer


def _claimed(api: Api) -> tuple[FakeAgent, wire.Assignment]:
    agent = api.agent("a")
    api.create_experiment()
    job = agent.claim()
    assert job is not None
    return agent, job


def _csrf(client: httpx.Client, path: str = "/login") -> str:
    found = re.search(r'name="_csrf_token" value="([^"]+)"', client.get(path).text)
    assert found is not None
    return found.group(1)


def _sign_in(client: httpx.Client, token: str) -> None:
    signed_in = client.post(
        "/login", data={"token": token, "next": "/", "_csrf_token": _csrf(client)}, follow_redirects=False
    )
    assert signed_in.status_code == 303, signed_in.text


def _signed_in_as(client: httpx.Client, name: str) -> bool:
    return f"<strong>{name}</strong>" in client.get("/agents").text


# Bounded reads -----------------------------------------------------------------------------------------------


def test_a_log_download_is_streamed_a_chunk_of_events_at_a_time(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pages, "LOG_CHUNK", 7)
    agent, job = _claimed(api)
    agent.printed(job, 0, *(f"line {index}" for index in range(50)))
    download = api.client.get(f"/jobs/{job.job_id}/attempts/{job.attempt_id}/log")
    assert download.status_code == 200 and "content-length" not in download.headers  # streamed, not held whole
    printed = [line.split("output", 1)[1].strip() for line in download.text.splitlines() if "output" in line]
    assert printed == [f"line {index}" for index in range(50)]


def test_an_events_page_ends_once_its_bytes_pass_the_limit_and_names_the_rest(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records, "MAX_PAGE_BYTES", 20_000)
    agent, job = _claimed(api)
    agent.printed(job, 0, *(f"{index:04d} " + "x" * 1000 for index in range(60)))
    first = api.get(f"/api/attempts/{job.attempt_id}/events?kind=output")
    assert 0 < len(first["items"]) < 60 and first["next"] is not None
    assert len(httpx.Response(200, json=first).content) < 20_000 + 2_000
    seen = first["items"]
    page = first
    while page["next"] is not None:
        page = api.get(f"/api/attempts/{job.attempt_id}/events?kind=output&after={page['next']}")
        seen += page["items"]
    assert [item["body"]["line"][:4] for item in seen] == [f"{index:04d}" for index in range(60)]


# Sessions and CSRF -------------------------------------------------------------------------------------------


def test_an_old_session_cookie_replayed_after_sign_out_signs_nobody_in(api: Api) -> None:
    client = api.client
    _sign_in(client, api.operator)
    assert _signed_in_as(client, "operator")
    cookie = client.cookies["coop_session"]
    signed_out = client.post("/logout", data={"_csrf_token": _csrf(client, "/agents")}, follow_redirects=False)
    assert signed_out.status_code == 303
    assert not _signed_in_as(client, "operator")
    client.cookies.set("coop_session", cookie)  # the stolen cookie, replayed
    page = client.get("/agents")
    assert page.status_code == 200 and "<strong>operator</strong>" not in page.text


def test_a_session_ends_at_its_absolute_lifetime_however_busy(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    _sign_in(api.client, api.operator)
    assert _signed_in_as(api.client, "operator")
    later = gate._now() + datetime.timedelta(hours=gate.SESSION_HOURS, seconds=1)
    monkeypatch.setattr(gate, "_now", lambda: later)
    assert not _signed_in_as(api.client, "operator")


def test_revoking_a_token_ends_its_sessions_at_once(api: Api) -> None:
    _sign_in(api.client, api.operator)
    assert _signed_in_as(api.client, "operator")

    async def revoke(session: AsyncSession) -> None:
        await tokens.revoke(session, "operator")

    with_session(api.url, revoke)
    assert not _signed_in_as(api.client, "operator")


def test_an_anonymous_csrf_pair_is_refused_on_an_operators_form(api: Api) -> None:
    client = api.client
    anonymous_token = _csrf(client)  # a pair anyone gets from the sign-in page
    anonymous_cookie = client.cookies["coop_csrf"]
    _sign_in(client, api.operator)
    client.cookies.set("coop_csrf", anonymous_cookie)
    forged = client.post("/logout", data={"_csrf_token": anonymous_token}, follow_redirects=False)
    assert forged.status_code == 403 and "is not this session" in forged.text
    assert _signed_in_as(client, "operator")


def test_a_form_from_another_origin_is_refused(api: Api) -> None:
    client = api.client
    _sign_in(client, api.operator)
    token = _csrf(client, "/agents")
    foreign = client.post(
        "/logout", data={"_csrf_token": token}, headers={"Origin": "https://evil.test"}, follow_redirects=False
    )
    assert foreign.status_code == 403 and "another site" in foreign.text
    assert _signed_in_as(client, "operator")
    own = client.post(
        "/logout", data={"_csrf_token": token}, headers={"Origin": str(client.base_url)}, follow_redirects=False
    )
    assert own.status_code == 303 and not _signed_in_as(client, "operator")


# Bodies ------------------------------------------------------------------------------------------------------


def test_a_bad_token_is_refused_before_a_large_body_is_read(api: Api) -> None:
    _, job = _claimed(api)
    body_size, chunk = 8_000_000, 64 * 1024
    read = 0
    answered: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        part = min(chunk, body_size - read)
        read += part
        return {"type": "http.request", "body": b" " * part, "more_body": read < body_size}

    async def send(message: dict[str, Any]) -> None:
        answered.append(message)

    path = f"/api/attempts/{job.attempt_id}/events"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"authorization", b"Bearer junk"),
            (b"content-type", b"application/json"),
            (b"content-length", str(body_size).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    api.client.blocking_portal.call(api.client.app, scope, receive, send)  # type: ignore[arg-type]
    assert answered[0]["status"] == 401
    assert read < 1_000_000, f"{read} bytes of the body were read before the 401"


def _batch(lease_token: str, value: str) -> str:
    """An event batch, as JSON text, whose one event's body holds ``value`` (JSON text) under "v"."""
    return f'{{"lease_token": "{lease_token}", "sequence": 0, "events": [{{"kind": "x", "body": {{"v": {value}}}}}]}}'


def test_a_body_nested_past_the_limit_is_refused_naming_it(api: Api) -> None:
    agent, job = _claimed(api)
    headers = bearer(agent.token) | {"Idempotency-Key": f"{job.job_id}:{job.attempt_id}:0"}
    path = f"/api/attempts/{job.attempt_id}/events"
    refused = api.client.post(path, content=_batch(job.lease_token, "[" * 1000 + "]" * 1000), headers=headers)
    assert refused.status_code == 400 and f"limit of {bodies.MAX_DEPTH} levels" in refused.json()["detail"]
    # Brackets inside a string are text, not nesting.
    shallow = _batch(job.lease_token, f'[{"[" * 50}{"]" * 50}, "{"[" * 2000}"]')
    assert api.client.post(path, content=shallow, headers=headers).status_code == 201


def test_a_deep_body_is_refused_on_an_operators_route_too(api: Api) -> None:
    nested = "[" * 1000 + "]" * 1000
    refused = api.client.post(
        "/api/experiments",
        content=f'{{"plan_toml": "", "x": {nested}}}',
        headers=bearer(api.operator) | {"content-type": "application/json"},
    )
    assert refused.status_code == 400 and str(bodies.MAX_DEPTH) in refused.json()["detail"]
    reader = make_token(api.url, "reader", "reader")
    assert api.client.post("/api/experiments", content="[]", headers=bearer(reader)).status_code == 403


# Headers, plans, files -----------------------------------------------------------------------------------------


def test_pages_forbid_framing_inline_scripts_and_the_referrer_to_other_sites(api: Api) -> None:
    for path in ("/", "/login"):
        headers = api.client.get(path).headers
        policy = headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "script-src 'self';" in policy and "unsafe-eval" not in policy
        assert headers["x-frame-options"] == "DENY" and headers["referrer-policy"] == "same-origin"
        assert "strict-transport-security" not in headers  # plain HTTP here; test_tls checks HSTS over TLS
    assert api.client.get("/api/experiments").headers["x-frame-options"] == "DENY"


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ('folder = "local-reference"', 'folder = "../../../../tmp/x"', "replay.folder"),
        ('folder = "local-reference"', 'folder = "/tmp/x"', "replay.folder"),
        ('path = "replay.jsonl"', 'path = "../../../../etc/passwd"', "replay.replay.path"),
        ('path = "retention.jsonl"', 'path = "/etc/shadow"', "replay.retention.path"),
        ('"config.json" =', '"../../../../etc/passwd" =', "seed.files"),
    ],
)
def test_a_plan_path_that_leads_out_of_its_folder_is_refused_naming_the_field(
    api: Api, old: str, new: str, field: str
) -> None:
    text = LOCAL_PLAN.read_text()
    assert old in text
    refused = api.operator_post("/api/experiments", {"plan_toml": text.replace(old, new, 1), "commit": False})
    assert refused.status_code == 400 and field in refused.json()["detail"], refused.text


def test_migrate_makes_an_open_home_and_its_database_private_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    monkeypatch.setenv("COOP_HOME", str(home))
    monkeypatch.delenv("COOP_DATABASE_URL", raising=False)
    previous = os.umask(0o022)
    try:
        with pytest.raises(SystemExit) as ended:
            cli.main(["migrate"])
        assert ended.value.code == 0
        database = home / "coordinator.sqlite3"
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        assert stat.S_IMODE(database.stat().st_mode) == 0o600
        said = capsys.readouterr().err
        assert "made the coordinator's home" in said and "0755 -> 0700" in said and "0644 -> 0600" in said
        with contextlib.closing(sqlite3.connect(database)) as connection:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("CREATE TABLE probe (x INTEGER)")
            for suffix in ("-wal", "-shm"):
                assert stat.S_IMODE((home / f"coordinator.sqlite3{suffix}").stat().st_mode) == 0o600
    finally:
        os.umask(previous)
