"""Browser tests: a real coordinator (``coop-server serve`` on SQLite) and Debian's Chromium driven by
Playwright. Playwright's own browsers are never installed; without /usr/bin/chromium the tests skip, except
in CI (CI set), where a missing browser is a failure: .ci/run installs it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, Playwright, sync_playwright

from tests.browser.support import off_thread
from tests.support.processes import QUICK, CoordinatorProcess

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
OUTPUT = Path(__file__).parent / "output"


# Module-scoped: Playwright's sync API keeps an event loop running in the test process while it is open, and any
# test after it in the same process that calls asyncio.run would fail; each browser file starts and stops its own.
@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make services` (as root) or `apt-get install chromium`")
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
    try:
        yield browser
    finally:
        browser.close()


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    home = tmp_path / "coordinator"
    home.mkdir()
    server = CoordinatorProcess(home, **QUICK)
    try:
        off_thread(server.start)
        yield server
    finally:
        server.close()


@pytest.fixture
def page(browser: Browser, coordinator: CoordinatorProcess) -> Iterator[Page]:
    context = browser.new_context(base_url=coordinator.url, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(20_000)
    try:
        yield context.new_page()
    finally:
        context.close()


def screenshot(page: Page, name: str) -> Path:
    OUTPUT.mkdir(exist_ok=True)
    path = OUTPUT / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
