"""The operator's web UI in a real browser against a real coordinator: sign in, create and steer an
experiment, watch it progress without reloading, read answers and the report."""

from __future__ import annotations

import json
from pathlib import Path

from playwright.sync_api import Page, expect

from tests.browser.conftest import screenshot
from tests.browser.support import Agent, create_experiment, experiment_through_testing, operator_post, sha, step
from tests.integration.agent.support import Coordinator
from tests.integration.coordinator.support import LOCAL_PLAN, answer, report_body, train_result

REPORT = Path(__file__).parent / "data" / "report-local.json"


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
            "expected": {"ids": [f"A{100 + a['index']}"]},
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


def test_advancing_is_refused_while_a_phase_runs_and_confirmed_before_selection(
    page: Page, coordinator: Coordinator
) -> None:
    sign_in(page, coordinator)
    page.get_by_label("or choose a plan file").set_input_files(LOCAL_PLAN)
    page.get_by_label("Autopilot", exact=False).uncheck()
    page.get_by_role("button", name="Create experiment").click()
    expect(page.get_by_test_id("autopilot")).to_have_text("off")
    a, b = Agent(coordinator, "host-a"), Agent(coordinator, "host-b")
    prepare = a.claim("prepare")
    a.finish(prepare, result={"prepared_identity": sha("prepared")})
    expect(page.get_by_test_id("state")).to_have_text("prepared")

    page.get_by_role("button", name="Advance to the next phase").click()
    expect(page.get_by_role("status")).to_contain_text(
        "queued train clean-single, train damaged-single, train clean-pair"
    )
    page.get_by_role("button", name="Advance to the next phase").click()
    expect(page.get_by_role("status")).to_contain_text("Refused: the training phase is still running")

    for agent in (a, b, a, b):  # the singles, then the pair's two ranks as one gang
        job = agent.claim("train")
        agent.finish(job, result=train_result(job["arm"]))
    expect(page.get_by_test_id("state")).to_have_text("trained")

    page.get_by_role("button", name="Advance to the next phase").click()
    expect(page.get_by_role("heading", name="Advance local from trained?")).to_be_visible()
    screenshot(page, "confirm-advance")
    page.get_by_role("button", name="Advance", exact=True).click()
    expect(page.get_by_role("status")).to_contain_text("queued evaluate dev seed")

    page.get_by_role("button", name="Turn autopilot on").click()
    expect(page.get_by_role("status")).to_contain_text("autopilot on")
    expect(page.get_by_test_id("autopilot")).to_have_text("on")


def test_the_report_page_shows_the_recorded_reports_verdict_and_comparisons(
    page: Page, coordinator: Coordinator
) -> None:
    experiment, _, _ = experiment_through_testing(coordinator)
    page.goto(f"/experiments/{experiment}/report")
    expect(page.get_by_text("No report recorded yet")).to_be_visible()

    serving = {"arm": "clean-pair", "model_identity": sha("clean-pair")}
    operator_post(coordinator, f"/api/experiments/{experiment}/serving", serving)
    report = json.loads(REPORT.read_text())  # what `coop report` wrote for a local run
    operator_post(coordinator, f"/api/experiments/{experiment}/report", report_body(report))
    page.reload()
    verdict = report["primary"]["verdict"]
    expect(page.get_by_test_id("verdict")).to_have_text("PASSED" if verdict["passed"] else "NOT PASSED")
    conditions = page.get_by_role("table").first
    for condition in verdict["conditions"]:
        row = conditions.get_by_role("row", name=condition["name"])
        expect(row).to_contain_text(f"{condition['value']:.6g}")
        expect(row).to_contain_text("pass" if condition["passed"] else "fail")
    paired = report["primary"]["paired"]
    expect(
        page.get_by_text(f"Wins {paired['wins']}, losses {paired['losses']} over {paired['n']} items")
    ).to_be_visible()
    comparisons = page.get_by_role("table").filter(has_text="comparison (arm vs baseline)")
    for name, row in report["descriptive"].items():
        if "wins" in row:
            expect(comparisons.get_by_role("row", name=name)).to_contain_text(f"{row['gain']:+.3f}")
    expect(page.locator("figure.chart svg")).to_have_count(4)
    screenshot(page, "report")


def test_an_operator_stops_a_running_replica_from_the_serving_page(page: Page, coordinator: Coordinator) -> None:
    experiment, a, b = experiment_through_testing(coordinator)
    serving = {"arm": "clean-pair", "model_identity": sha("clean-pair")}
    operator_post(coordinator, f"/api/experiments/{experiment}/serving", serving)
    operator_post(coordinator, f"/api/experiments/{experiment}/advance", {})  # a replica on each host of the pair
    sign_in(page, coordinator)
    page.goto(f"/experiments/{experiment}/serving")
    expect(page.get_by_test_id("replica-1")).to_contain_text("starting")
    expect(page.get_by_role("button", name="Stop rank 1's replica")).to_have_count(0)  # cancelled, not stopped
    for agent, rank in ((a, 0), (b, 1)):
        job = agent.claim("replica-start")
        result = {"probe_url": f"http://host-{rank}:9000", "replica_url": "http://127.0.0.1:8000", "rank": rank}
        agent.finish(job, result=result | {"model_identity": sha("clean-pair")})
    page.reload()
    expect(page.get_by_test_id("replica-0")).to_contain_text("running")
    page.get_by_role("button", name="Stop rank 1's replica").click()
    expect(page.get_by_role("heading", name="Stop rank 1's replica?")).to_be_visible()
    page.get_by_role("button", name="Stop replica").click()
    expect(page.get_by_role("status")).to_contain_text("queued replica-stop for rank 1")
    expect(page.get_by_test_id("replica-1")).to_have_count(0)  # its stop is queued: no longer listed as running
    expect(page.get_by_test_id("replica-0")).to_contain_text("running")
    assert a.try_claim("replica-stop") is None  # the stop runs on rank 1's host
    stop = b.claim("replica-stop")
    assert stop["spec"] == {"rank": 1, "serving_token": stop["spec"]["serving_token"]}
    screenshot(page, "replica-stopped")
