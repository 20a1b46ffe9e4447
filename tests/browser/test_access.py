"""Who may do what on the web UI's routes: reads as public as the API's, actions only for a signed-in
operator with the form's CSRF token (its session's own: the sign-in page's anonymous one no longer serves), and a
session that never stands in for the API's bearer token."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from litestar.testing import TestClient
from playwright.sync_api import Browser, expect
from sqlalchemy.ext.asyncio import AsyncSession

from server import migrate
from server.access import tokens
from server.app import create_app
from server.settings import Settings, sqlite_url
from tests.browser.conftest import screenshot
from tests.browser.support import off_thread
from tests.support.database import make_token, with_session
from tests.support.processes import CoordinatorProcess
from tests.support.scenarios import LOCAL_PLAN, bearer, create_experiment


def _csrf(http: httpx.Client) -> str:
    found = re.search(r'name="_csrf_token" value="([^"]+)"', http.get("/login").text)
    assert found is not None
    return found.group(1)


def test_a_session_is_no_bearer_token_and_every_action_needs_it_and_the_csrf_token(
    coordinator: CoordinatorProcess,
) -> None:
    plan = {"plan_toml": LOCAL_PLAN.read_text(), "commit": "yes"}
    with httpx.Client(base_url=coordinator.url) as stranger:
        csrf = _csrf(stranger)
        refused = stranger.post("/experiments", data={**plan, "_csrf_token": csrf}, files={"plan_file": ("", b"")})
        assert refused.status_code == 303 and refused.headers["location"].startswith("/login")

    with httpx.Client(base_url=coordinator.url) as http:
        csrf = _csrf(http)
        signed_in = http.post("/login", data={"token": coordinator.operator, "next": "/", "_csrf_token": csrf})
        assert signed_in.status_code == 303 and "coop_session" in http.cookies
        assert (
            http.post("/experiments", data={**plan, "_csrf_token": csrf}, files={"plan_file": ("", b"")}).status_code
            == 403
        )
        csrf = _csrf(http)  # signing in gave the browser a token of its session's own
        assert http.post("/api/experiments", json={"plan_toml": plan["plan_toml"]}).status_code == 401
        forged = http.post("/experiments", data=plan, files={"plan_file": ("", b"")})
        assert forged.status_code == 403 and "CSRF" in forged.text
        assert http.post("/login?next=//elsewhere.test", data={"token": coordinator.operator}).status_code == 403
        offsite = http.post(
            "/login", data={"token": coordinator.operator, "next": "//elsewhere.test", "_csrf_token": csrf}
        )
        assert offsite.headers["location"] == "/"
        csrf = _csrf(http)  # that sign-in began a session of its own, with its own token

        async def revoke(session: AsyncSession) -> None:
            await tokens.revoke(session, "operator")

        off_thread(with_session, coordinator.database_url, revoke)
        after = http.post("/experiments", data={**plan, "_csrf_token": csrf}, files={"plan_file": ("", b"")})
        assert after.status_code == 303 and after.headers["location"].startswith("/login")


def test_pages_need_a_sign_in_where_reads_are_not_public(tmp_path: Path) -> None:
    def run() -> None:
        url = sqlite_url(tmp_path / "coordinator.sqlite3")
        migrate.upgrade(url)
        with TestClient(create_app(Settings(home=tmp_path, database_url=url, public_read=False))) as client:
            page = client.get("/agents", follow_redirects=False)
            assert page.status_code == 303 and page.headers["location"] == "/login?next=/agents"
            assert client.get("/login").status_code == 200
            assert client.get("/static/coop.css").status_code == 200
            assert client.get("/api/agents").status_code == 401
        assert (tmp_path / "web-secret").stat().st_mode & 0o777 == 0o600

    off_thread(run)


def test_read_pages_work_without_javascript(browser: Browser, coordinator: CoordinatorProcess) -> None:
    experiment = create_experiment(coordinator)["id"]
    context = browser.new_context(base_url=coordinator.url, java_script_enabled=False)
    try:
        page = context.new_page()
        page.goto("/")
        page.get_by_role("link", name="local").click()
        expect(page.get_by_test_id("state")).to_have_text("committed")
        for tab, text in (
            ("Arms", "clean-pair"),
            ("Jobs", "prepare"),
            ("Evaluations", "No test answer"),
            ("Report", "No report"),
        ):
            page.get_by_role("link", name=tab, exact=True).click()
            expect(page.get_by_role("main")).to_contain_text(text)
        assert page.url.endswith(f"/experiments/{experiment}/report")
        screenshot(page, "no-javascript")
    finally:
        context.close()


def test_a_reader_signs_in_to_read_the_pages_and_is_refused_every_action(tmp_path: Path) -> None:
    def run() -> None:
        url = sqlite_url(tmp_path / "coordinator.sqlite3")
        migrate.upgrade(url)
        reader = make_token(url, "reader", "analyst")
        operator = make_token(url, "operator", "operator")
        with TestClient(create_app(Settings(home=tmp_path, database_url=url, public_read=False))) as client:
            body = {"plan_toml": LOCAL_PLAN.read_text(), "commit": True, "autopilot": False}
            experiment = client.post("/api/experiments", json=body, headers=bearer(operator)).json()["id"]
            csrf = _csrf(client)
            signed_in = client.post(
                "/login", data={"token": reader, "next": "/agents", "_csrf_token": csrf}, follow_redirects=False
            )
            assert signed_in.status_code == 303 and signed_in.headers["location"] == "/agents"
            csrf = _csrf(client)  # the signed-in session's own token
            assert client.get("/agents").status_code == 200
            overview = client.get(f"/experiments/{experiment}")
            assert overview.status_code == 200 and f'action="/experiments/{experiment}/advance"' not in overview.text
            assert "Reader <strong>analyst</strong>" in overview.text
            for action in (f"/experiments/{experiment}/advance", f"/experiments/{experiment}/autopilot"):
                refused = client.post(action, data={"_csrf_token": csrf, "on": "off"}, follow_redirects=False)
                assert refused.status_code == 403 and "reader token, which reads only" in refused.text
            state = client.get(f"/api/experiments/{experiment}", headers=bearer(reader)).json()
            assert state["state"] == "committed" and state["autopilot"] is False
            assert client.get("/api/agents").status_code == 401  # the session is no bearer token

    off_thread(run)


def test_the_pages_run_htmx_and_draw_their_figures_under_the_content_security_policy(
    browser: Browser, coordinator: CoordinatorProcess
) -> None:
    experiment = create_experiment(coordinator)["id"]
    context = browser.new_context(base_url=coordinator.url)
    refused: list[str] = []
    try:
        page = context.new_page()
        page.on(
            "console",
            lambda message: refused.append(message.text) if "Content Security Policy" in message.text else None,
        )
        for path in ("/", f"/experiments/{experiment}", f"/experiments/{experiment}/jobs", "/agents", "/login"):
            response = page.goto(path)
            assert response is not None and "frame-ancestors 'none'" in response.headers["content-security-policy"]
            assert page.evaluate("typeof window.htmx") == "object"
        with page.expect_response(lambda answer: answer.url.endswith("/jobs/live")):  # htmx polls under the policy
            page.goto(f"/experiments/{experiment}/jobs")
        assert refused == []
    finally:
        context.close()
