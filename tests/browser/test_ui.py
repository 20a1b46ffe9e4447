"""The operator's web UI in a real browser against a real coordinator: sign in, create and steer an
experiment, watch it progress without reloading, read answers and the report."""

from __future__ import annotations

import json

from playwright.sync_api import Page, expect

from tests.browser.conftest import screenshot
from tests.browser.support import Agent, create_experiment, operator_post, sha, step
from tests.integration.agent.support import Coordinator
from tests.integration.coordinator.support import LOCAL_PLAN, answer


def sign_in(page: Page, coordinator: Coordinator) -> None:
    page.goto("/")
    page.get_by_role("link", name="Operator sign-in").click()
    page.get_by_label("Operator token").fill(coordinator.operator)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_text("Operator operator")).to_be_visible()


def test_an_operator_signs_in_creates_an_experiment_from_a_plan_file_and_cancels_its_job(
    page: Page, coordinator: Coordinator
) -> None:
    page.goto("/login")
    page.get_by_label("Operator token").fill("coop_not-a-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("not an operator token")

    sign_in(page, coordinator)
    page.get_by_label("or choose a plan file").set_input_files(LOCAL_PLAN)
    page.get_by_role("button", name="Create experiment").click()
    expect(page.get_by_role("status")).to_contain_text("created experiment local (committed)")
    expect(page.get_by_test_id("state")).to_have_text("committed")
    expect(page.locator("ol.timeline")).to_contain_text("plan committed")
    expect(page.get_by_role("table").filter(has_text="previous hash")).to_contain_text("plan")
    expect(page.get_by_text("left", exact=False).first).to_be_visible()  # the deadline countdown

    page.keyboard.press("Tab")
    outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline == "solid", "keyboard focus must be visible"
    screenshot(page, "overview")

    page.get_by_role("link", name="Jobs").click()
    page.get_by_role("link", name="prepare").click()
    page.get_by_role("button", name="Cancel job").click()
    expect(page.get_by_role("heading", name="Cancel this job?")).to_be_visible()
    page.get_by_role("button", name="Cancel this job").click()
    expect(page.get_by_role("status")).to_contain_text("asked job")
    expect(page.get_by_test_id("job-state")).to_have_text("cancelled")
    screenshot(page, "cancelled")


def test_progress_loss_and_log_update_without_reloading(page: Page, coordinator: Coordinator) -> None:
    experiment = create_experiment(coordinator)["id"]
    agent = Agent(coordinator, "host-a")
    page.goto(f"/experiments/{experiment}")
    expect(page.get_by_test_id("state")).to_have_text("committed")
    page.evaluate("window.notReloaded = true")

    prepare = agent.claim("prepare")
    agent.finish(prepare, result={"prepared_identity": sha("prepared")})
    expect(page.locator("ol.timeline")).to_contain_text("prepared")
    assert page.evaluate("window.notReloaded") is True

    train = agent.claim("train")
    arm = train["arm"]
    page.goto(f"/experiments/{experiment}/arms")
    page.evaluate("window.notReloaded = true")
    done = page.get_by_test_id(f"done-{arm}-0")
    expect(done).to_have_text("0")
    agent.events(train, 0, step(arm, 1, 2.5), step(arm, 2, 2.1))
    expect(done).to_have_text("2")
    agent.events(train, 1, *(step(arm, n, 2.0 - n / 10) for n in range(3, 8)))
    expect(done).to_have_text("7")
    expect(page.locator("figure.chart svg")).to_be_visible()
    assert page.evaluate("window.notReloaded") is True
    screenshot(page, "arms")

    page.goto(f"/jobs/{train['job_id']}")
    page.evaluate("window.notReloaded = true")
    agent.events(train, 2, {"line": "checkpoint written at step 64"})
    expect(page.get_by_test_id("log")).to_contain_text("checkpoint written at step 64")
    agent.finish(train, outcome="failed", reason="the loss was not finite")
    expect(page.get_by_test_id("job-state")).to_have_text("failed")
    expect(page.get_by_role("table")).to_contain_text("the loss was not finite")
    assert page.evaluate("window.notReloaded") is True
    screenshot(page, "job")

    page.goto("/agents")
    expect(page.get_by_role("row", name="host-a")).to_contain_text("cpu_count")


def test_an_answer_opens_with_its_prompt_output_and_check(page: Page, coordinator: Coordinator) -> None:
    experiment = create_experiment(coordinator)["id"]
    agent = Agent(coordinator, "host-a")
    answers = [answer(0, True, "lookup", 0), answer(1, False, "filter", 1), answer(2, True, "total", 0)]
    tasks = [
        {
            "id": a["id"],
            "role": "dev",
            "index": a["index"],
            "family": a["family"],
            "variant": a["variant"],
            "input_dependent": a["input_dependent"],
            "prompt": f"Task {a['index']}: answer with one JSON object.",
            "expected": {"a": a["index"]},
            "prompt_ids": a["prompt_ids"],
        }
        for a in answers
    ]
    dev = agent.upload("".join(json.dumps(task) + "\n" for task in tasks).encode())
    prepare = agent.claim("prepare")
    agent.finish(prepare, result={"prepared_identity": sha("prepared")}, evidence={"prepared/dev.jsonl": dev})
    operator_post(
        coordinator, f"/api/experiments/{experiment}/jobs", {"kind": "evaluate", "arm": "seed", "role": "dev"}
    )
    evaluation = agent.claim("evaluate")
    agent.finish(evaluation, answers=answers)

    page.goto(f"/experiments/{experiment}/evaluations?role=dev")
    grid = page.get_by_role("table").first
    expect(grid).to_contain_text("2/3")
    page.get_by_role("link", name="#1").click()
    expect(page.get_by_role("heading", name="seed on dev task #1")).to_be_visible()
    expect(page.get_by_test_id("check")).to_contain_text("wrong_schema_or_value")
    expect(page.get_by_text("Task 1: answer with one JSON object.")).to_be_visible()
    expect(page.get_by_test_id("output")).to_have_text('{"a": 1}')
    screenshot(page, "answer")


def test_the_report_page_waits_for_the_recorded_report(page: Page, coordinator: Coordinator) -> None:
    experiment = create_experiment(coordinator)["id"]
    page.goto(f"/experiments/{experiment}/report")
    expect(page.get_by_text("No report recorded yet")).to_be_visible()
    page.get_by_role("link", name="Serving").click()
    expect(page.get_by_text("No serving results yet")).to_be_visible()
    screenshot(page, "report-pending")
