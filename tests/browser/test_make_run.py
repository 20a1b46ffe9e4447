"""What `make run` leaves an operator: the script it runs (scripts/local-run.sh) to its report, then the sign-in
line it printed, the 0600 token file it names, and in Chromium a second experiment halted by that token's operator.
The plan is the local-SGD one with the tests' small counts (four agents, no serving), so the run takes a minute."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, expect

from experiment.seed import seedmodel
from tests.browser.conftest import screenshot
from tests.conftest import write_plan
from tests.support import ROOT
from tests.support.processes import free_port
from tests.support.scenarios import LOCAL_PLAN, bearer

SIGN_IN = re.compile(r"sign in: (?P<url>\S+)/login with the token in (?P<file>\S+)$")
RUN_SECONDS = 600


class Run:
    """scripts/local-run.sh in the background, its output read line by line as it comes."""

    def __init__(self, plan: Path) -> None:
        env = {**os.environ, "COOP_PLAN": str(plan), "COOP_PORT": str(free_port())}
        env.pop("COOP_EXIT_WHEN_DONE", None)
        self.process = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "local-run.sh")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str) -> re.Match[str]:
        """The first line that ``pattern`` matches, once the script has printed it."""
        with self._changed:
            while True:
                found = next((m for line in self.lines if (m := re.search(pattern, line))), None)
                if found is not None:
                    return found
                if self.process.poll() is not None:
                    pytest.fail(
                        f"make run ended ({self.process.returncode}) without {pattern!r}:\n" + "\n".join(self.lines)
                    )
                if not self._changed.wait(timeout=RUN_SECONDS):
                    pytest.fail(f"make run printed no {pattern!r} in {RUN_SECONDS} s:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        """Ctrl-C, as the operator ends it: the script stops the coordinator and the agents."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture
def make_run(tmp_path: Path) -> Iterator[Run]:
    plan = write_plan(
        tmp_path / "plan.toml",
        seedmodel.snapshot_of(ROOT / "seeds" / "tiny"),
        base=ROOT / "plans" / "local-diloco.toml",
        checkpoint_steps=[4],
    )
    run = Run(plan)
    try:
        yield run
    finally:
        run.stop()
        found = [m for line in run.lines if (m := SIGN_IN.search(line))]
        if found:  # the run's own folder under .coop, as make run made it
            shutil.rmtree(Path(found[0]["file"]).parent, ignore_errors=True)


def test_after_make_run_an_operator_signs_in_with_the_printed_token_file_and_halts_a_second_experiment(
    make_run: Run, browser: Browser
) -> None:
    sign_in = make_run.wait_for(SIGN_IN.pattern)
    url, token_file = sign_in["url"], Path(sign_in["file"])
    assert token_file.stat().st_mode & 0o777 == 0o600
    make_run.wait_for(r"^verdict \(")
    make_run.wait_for(r"the coordinator stays up for the web UI")
    token = token_file.read_text().strip()
    (first,) = httpx.get(f"{url}/api/experiments").json()
    assert first["state"] == "reported"

    body = {"plan_toml": LOCAL_PLAN.read_text(), "commit": True, "autopilot": False}
    second = httpx.post(f"{url}/api/experiments", json=body, headers=bearer(token)).json()["id"]
    context = browser.new_context(base_url=url, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(20_000)
    try:
        page = context.new_page()
        page.goto("/login")
        page.get_by_label("Operator or reader token").fill(token_file.read_text())
        page.get_by_role("button", name="Sign in").click()
        expect(page.get_by_text("Operator operator")).to_be_visible()
        page.goto(f"/experiments/{second}")
        page.get_by_role("button", name="Halt experiment").click()
        page.get_by_role("button", name="Halt experiment").click()
        expect(page.get_by_test_id("state")).to_have_text("halted")
        screenshot(page, "make-run-halted")
    finally:
        context.close()
    states = {e["id"]: e["state"] for e in httpx.get(f"{url}/api/experiments").json()}
    assert states == {first["id"]: "reported", second: "halted"}
