"""The report's paired comparisons, item by item, in a real browser: each comparison's page lists exactly the test
items one arm answers right and the other wrong, as the recorded answers give them and in the report's numbers,
and each item opens every arm's answer to its task side by side."""

from __future__ import annotations

import json
from pathlib import Path

from playwright.sync_api import Page, expect

from tests.browser.conftest import screenshot
from tests.browser.support import (
    finished_experiment,
    host_agent,
    off_thread,
    recorded_answers,
    smollm2_lines,
    smollm2_report,
)
from tests.support.database import record_report
from tests.support.processes import CoordinatorProcess
from tests.support.scenarios import experiment_through_testing, operate, sha

REPORT_LOCAL = Path(__file__).parent / "data" / "report-local.json"


def listed(page: Page, name: str) -> list[str]:
    """The task ids of a wins or losses table, in the page's order; none where the page says none."""
    table = page.get_by_test_id(name)
    if table.count() == 0:
        expect(page.get_by_test_id(f"{name}-none")).to_be_visible()
        return []
    ids: list[str] = table.locator("tbody tr").evaluate_all("rows => rows.map(row => row.dataset.taskId)")
    return ids


def one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def test_each_comparison_lists_exactly_the_reports_wins_and_losses_and_opens_every_arms_answer(
    page: Page, coordinator: CoordinatorProcess
) -> None:
    experiment = finished_experiment(coordinator, host_agent(coordinator, "host-a"), host_agent(coordinator, "host-b"))
    report = smollm2_report()
    answers = recorded_answers(coordinator, experiment, report["arms"])
    stated = [report["primary"]] + report["descriptive"]["comparisons"]
    for number, comparison in enumerate(stated):
        baseline, arm, counts = comparison["baseline"], comparison["arm"], comparison["paired"]
        # The truth, apart from the page: the recorded answers, paired by task, and the report's counts of them.
        theirs, ours = answers[baseline], answers[arm]
        assert theirs.keys() == ours.keys() and len(ours) == counts["n"]
        wins = sorted(
            (a["index"], task)
            for task, a in ours.items()
            if a["check"]["correct"] and not theirs[task]["check"]["correct"]
        )
        losses = sorted(
            (a["index"], task)
            for task, a in ours.items()
            if theirs[task]["check"]["correct"] and not a["check"]["correct"]
        )
        assert (len(wins), len(losses)) == (counts["wins"], counts["losses"])

        page.goto(f"/experiments/{experiment}/report")
        if number == 0:
            page.get_by_test_id("primary-items").click()
        else:
            table = page.get_by_role("table").filter(has_text="comparison (arm vs baseline)")
            table.get_by_role("link", name=f"{arm} vs {baseline}", exact=True).click()
        expect(page.get_by_role("heading", level=2)).to_contain_text(f"{arm} vs {baseline}")
        counted = page.get_by_test_id("counts")
        expect(counted).to_contain_text(f"{counts['wins']} wins, {counts['losses']} losses over {counts['n']} items")
        expect(page.get_by_test_id("disagrees")).to_have_count(0)
        assert listed(page, "wins") == [task for _, task in wins]
        assert listed(page, "losses") == [task for _, task in losses]
        if wins and losses:
            screenshot(page, "compare")

    # A loss of clean-single against damaged-single opens its task: every arm's answer, side by side.
    page.goto(f"/experiments/{experiment}/report/compare/clean-single/vs/damaged-single")
    first = page.get_by_test_id("losses").locator("tbody tr").first
    task_id = first.get_attribute("data-task-id")
    assert task_id is not None
    first.get_by_role("link").click()
    expect(page.get_by_role("heading", level=2)).to_contain_text("every arm's answer")
    prepared = next(task for task in smollm2_lines("prepared/test.jsonl") if task["id"] == task_id)
    assert one_line(page.get_by_test_id("prompt").text_content()) == one_line(prepared["prompt"])
    cards = page.locator(".side-by-side article")
    expect(cards).to_have_count(len(report["arms"]))
    for arm in report["arms"]:
        answer = answers[arm][task_id]
        card = page.get_by_test_id(f"arm-{arm}")
        assert one_line(card.get_by_test_id("output").text_content()) == one_line(answer["text"])
        expect(card.get_by_test_id("check")).to_contain_text(answer["check"]["reason"])
    right = [arm for arm in report["arms"] if answers[arm][task_id]["check"]["correct"]]
    expect(page.get_by_test_id("right")).to_have_text(", ".join(right))
    assert "damaged-single" in right and "clean-single" not in right
    screenshot(page, "task")

    # Every other input is answered with a reason, never a server error.
    for path, status in [
        (f"/experiments/{experiment}/report/compare/seed/vs/clean-single", 404),  # the report states the other way
        (f"/experiments/{experiment}/report/compare/nobody/vs/seed", 404),
        (f"/experiments/{experiment}/tasks/train/{task_id}", 400),
        (f"/experiments/{experiment}/tasks/test/{'0' * 64}", 404),
        (f"/experiments/{sha('none')[:8]}-0000-7000-8000-000000000000/tasks/test/{task_id}", 404),
    ]:
        response = coordinator.http.get(path)
        assert response.status_code == status, (path, response.status_code, response.text)


def test_a_comparison_whose_recorded_answers_are_not_the_reports_says_so(
    page: Page, coordinator: CoordinatorProcess
) -> None:
    """A report recorded over other answers (here: a local run's report over one answer per arm) is still listed,
    with the answers' own wins and losses, and an alert that they are not the report's."""
    experiment = experiment_through_testing(
        coordinator, host_agent(coordinator, "host-a"), host_agent(coordinator, "host-b")
    )
    operate(
        coordinator,
        f"/api/experiments/{experiment}/serving",
        {"arm": "clean-pair", "model_identity": sha("clean-pair")},
    )
    report = json.loads(REPORT_LOCAL.read_text())
    off_thread(record_report, coordinator.database_url, coordinator.home, experiment, report)
    page.goto(f"/experiments/{experiment}/report/compare/clean-single/vs/seed")
    expect(page.get_by_test_id("counts")).to_contain_text("0 wins, 0 losses over 1 items")
    expect(page.get_by_test_id("disagrees")).to_contain_text("not computed from these answers")
