"""The operator's web UI in a real browser against a real coordinator: sign in, create and steer an
experiment, watch it progress without reloading, read answers, the serving phases, the hosts' work and the
report."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

from playwright.sync_api import Locator, Page, expect

from server.web.render import duration
from tests.browser.conftest import screenshot
from tests.browser.support import (
    attempt_events,
    attempts_by_host,
    host_agent,
    job_times,
    off_thread,
    phase_report,
    serving_section,
    step,
)
from tests.support.agent import FakeAgent, answer
from tests.support.database import make_token, record_report
from tests.support.processes import CoordinatorProcess
from tests.support.scenarios import (
    LOCAL_PLAN,
    create_experiment,
    experiment_through_testing,
    local_sgd_through_testing,
    operate,
    sha,
    train_result,
)

REPORT = Path(__file__).parent / "data" / "report-local.json"
# What the coordinator recorded for `make run PLAN=plans/local-diloco.toml`.
REPORT_LOCAL_SGD = Path(__file__).parent / "data" / "report-local-diloco.json"
PHASES = ("single", "pair", "failure")
SERVED = {"arm": "clean-pair", "model_identity": sha("clean-pair")}


def sign_in(page: Page, coordinator: CoordinatorProcess) -> None:
    page.goto("/login")
    page.get_by_label("Operator or reader token").fill(coordinator.operator)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_text("Operator operator")).to_be_visible()


def test_an_operator_signs_in_creates_an_experiment_from_a_plan_file_and_cancels_its_job(
    page: Page, coordinator: CoordinatorProcess
) -> None:
    page.goto("/")
    page.get_by_role("banner").get_by_role("link", name="Sign in").click()
    page.get_by_label("Operator or reader token").fill("coop_not-a-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("not an operator")

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


def test_progress_loss_and_log_update_without_reloading(page: Page, coordinator: CoordinatorProcess) -> None:
    experiment = create_experiment(coordinator)["id"]
    agent = host_agent(coordinator, "host-a")
    page.goto(f"/experiments/{experiment}")
    expect(page.get_by_test_id("state")).to_have_text("committed")
    page.evaluate("window.notReloaded = true")

    prepare = agent.take("prepare")
    agent.finish(prepare, result={"prepared_identity": sha("prepared")})
    expect(page.locator("ol.timeline")).to_contain_text("prepared")
    assert page.evaluate("window.notReloaded") is True

    train = agent.take("train")
    arm = str(train.arm)
    page.goto(f"/experiments/{experiment}/arms")
    page.evaluate("window.notReloaded = true")
    done = page.get_by_test_id(f"done-{arm}-0")
    expect(done).to_have_text("0")
    agent.printed(train, 0, step(arm, 1, 2.5), step(arm, 2, 2.1))
    expect(done).to_have_text("2")
    agent.printed(train, 1, *(step(arm, n, 2.0 - n / 10) for n in range(3, 8)))
    expect(done).to_have_text("7")
    expect(page.locator("figure.chart svg")).to_be_visible()
    assert page.evaluate("window.notReloaded") is True
    screenshot(page, "arms")

    page.goto(f"/jobs/{train.job_id}")
    page.evaluate("window.notReloaded = true")
    agent.printed(train, 2, "checkpoint written at step 64")
    expect(page.get_by_test_id("log")).to_contain_text("checkpoint written at step 64")
    agent.finish(train, outcome="failed", reason="the loss was not finite")
    expect(page.get_by_test_id("job-state")).to_have_text("failed")
    expect(page.get_by_role("table")).to_contain_text("the loss was not finite")
    assert page.evaluate("window.notReloaded") is True
    screenshot(page, "job")

    page.goto("/agents")
    expect(page.get_by_role("row", name="host-a")).to_contain_text("cpu_count")


def test_an_answer_opens_with_its_prompt_output_and_check(page: Page, coordinator: CoordinatorProcess) -> None:
    experiment = create_experiment(coordinator)["id"]
    agent = host_agent(coordinator, "host-a")
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
    prepare = agent.take("prepare")
    dev = agent.upload("".join(json.dumps(task) + "\n" for task in tasks).encode(), prepare)
    agent.finish(prepare, result={"prepared_identity": sha("prepared")}, evidence={"prepared/dev.jsonl": dev})
    operate(coordinator, f"/api/experiments/{experiment}/jobs", {"kind": "evaluate", "arm": "seed", "role": "dev"})
    evaluation = agent.take("evaluate")
    agent.evaluated(evaluation, answers)

    page.goto(f"/experiments/{experiment}/evaluations?role=dev")
    grid = page.get_by_role("table").first
    expect(grid).to_contain_text("2/3")
    page.get_by_role("link", name="#1").click()
    expect(page.get_by_role("heading", name="seed on dev task #1")).to_be_visible()
    expect(page.get_by_test_id("check")).to_contain_text("wrong_schema_or_value")
    expect(page.get_by_text("Task 1: answer with one JSON object.")).to_be_visible()
    expect(page.get_by_test_id("output")).to_have_text('{"a": 1}')
    screenshot(page, "answer")


def test_the_report_page_waits_for_the_recorded_report(page: Page, coordinator: CoordinatorProcess) -> None:
    experiment = create_experiment(coordinator)["id"]
    page.goto(f"/experiments/{experiment}/report")
    expect(page.get_by_text("No report recorded yet")).to_be_visible()
    page.get_by_role("link", name="Serving").click()
    expect(page.get_by_text("No serving results yet")).to_be_visible()
    screenshot(page, "report-pending")


def test_advancing_is_refused_while_a_phase_runs_and_confirmed_before_selection(
    page: Page, coordinator: CoordinatorProcess
) -> None:
    sign_in(page, coordinator)
    page.get_by_label("or choose a plan file").set_input_files(LOCAL_PLAN)
    page.get_by_label("Autopilot", exact=False).uncheck()
    page.get_by_role("button", name="Create experiment").click()
    expect(page.get_by_test_id("autopilot")).to_have_text("off")
    a, b = host_agent(coordinator, "host-a"), host_agent(coordinator, "host-b")
    prepare = a.take("prepare")
    a.finish(prepare, result={"prepared_identity": sha("prepared")})
    expect(page.get_by_test_id("state")).to_have_text("prepared")

    page.get_by_role("button", name="Advance to the next phase").click()
    expect(page.get_by_role("status")).to_contain_text(
        "queued train clean-single, train damaged-single, train clean-pair"
    )
    page.get_by_role("button", name="Advance to the next phase").click()
    expect(page.get_by_role("status")).to_contain_text("Refused: the training phase is still running")

    for agent in (a, b, a, b):  # the singles, then the pair's two ranks as one gang
        job = agent.take("train")
        agent.finish(job, result=train_result(str(job.arm)))
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
    page: Page, coordinator: CoordinatorProcess
) -> None:
    experiment = experiment_through_testing(
        coordinator, host_agent(coordinator, "host-a"), host_agent(coordinator, "host-b")
    )
    page.goto(f"/experiments/{experiment}/report")
    expect(page.get_by_text("No report recorded yet")).to_be_visible()

    serving = {"arm": "clean-pair", "model_identity": sha("clean-pair")}
    operate(coordinator, f"/api/experiments/{experiment}/serving", serving)
    report = json.loads(REPORT.read_text())  # what `coop report` wrote for a local run
    off_thread(record_report, coordinator.database_url, coordinator.home, experiment, report)
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
    for comparison in report["descriptive"]["comparisons"]:
        name = f"{comparison['arm']} vs {comparison['baseline']}"
        expect(comparisons.get_by_role("row", name=name)).to_contain_text(f"{comparison['paired']['gain']:+.3f}")
    expect(page.locator("figure.chart svg")).to_have_count(4)
    screenshot(page, "report")


def test_an_operator_stops_a_running_replica_from_the_serving_page(page: Page, coordinator: CoordinatorProcess) -> None:
    a, b = host_agent(coordinator, "host-a"), host_agent(coordinator, "host-b")
    experiment = experiment_through_testing(coordinator, a, b)
    serving = {"arm": "clean-pair", "model_identity": sha("clean-pair")}
    operate(coordinator, f"/api/experiments/{experiment}/serving", serving)  # its replicas queued at selection
    sign_in(page, coordinator)
    page.goto(f"/experiments/{experiment}/serving")
    expect(page.get_by_test_id("replica-1")).to_contain_text("starting")
    expect(page.get_by_role("button", name="Stop rank 1's replica")).to_have_count(0)  # cancelled, not stopped
    for agent, rank in ((a, 0), (b, 1)):
        job = agent.take("replica-start")
        result = {"probe_url": f"http://host-{rank}:9000", "replica_url": "http://127.0.0.1:8000", "rank": rank}
        agent.finish(job, result=result | {"model_identity": sha("clean-pair")})
    page.reload()
    expect(page.get_by_test_id("replica-0")).to_contain_text("running")
    page.get_by_role("button", name="Stop rank 1's replica").click()
    expect(page.get_by_role("heading", name="Stop rank 1's replica?")).to_be_visible()
    page.get_by_role("button", name="Stop replica").click()
    expect(page.get_by_role("status")).to_contain_text("queued replica-stop for rank 1")
    expect(page.get_by_test_id("replica-1")).to_have_count(0)  # its stop is queued: not listed as running
    expect(page.get_by_test_id("replica-0")).to_contain_text("running")
    assert a.try_take("replica-stop") is None  # the stop runs on rank 1's host
    stop = b.take("replica-stop")
    assert stop.spec == {"rank": 1, "serving_token": stop.spec["serving_token"]}
    screenshot(page, "replica-stopped")


def cells(table: Locator, label: str) -> Locator:
    """The data cells of the table's row headed exactly ``label``."""
    header = table.page.locator("th", has_text=re.compile(f"^{re.escape(label)}$"))
    return table.locator("tr", has=header).locator("td")


def fact(facts: Locator, term: str) -> Locator:
    """The definition of ``term`` in a definition list."""
    return facts.locator("dt", has_text=re.compile(f"^{re.escape(term)}$")).locator("xpath=following-sibling::dd[1]")


def serve(coordinator: CoordinatorProcess, experiment: str, a: FakeAgent, b: FakeAgent) -> None:
    """The serving commitment, and the replica on each host of the pair queued with the test evaluations (a holds
    rank 0, b rank 1) started."""
    operate(coordinator, f"/api/experiments/{experiment}/serving", SERVED)
    for agent, rank in ((a, 0), (b, 1)):
        job = agent.take("replica-start")
        result = {"probe_url": f"http://host-{rank}:9000", "replica_url": "http://127.0.0.1:8000", "rank": rank}
        agent.finish(job, result=result | {"model_identity": sha("clean-pair")})


def benchmark(agent: FakeAgent, report: dict[str, Any]) -> None:
    job = agent.take("benchmark")
    assert job.spec["phase"] == report["phase"]
    agent.finish(job, serving=[{"phase": report["phase"], "report": report}])


# The side-by-side rows the serving and report pages share, with the format each shows.
MEASURES = [
    ("requests", "requests", "d"),
    ("completed", "completed", "d"),
    ("correct", "correct", "d"),
    ("requests per second", "request_throughput", ".2f"),
    ("output tokens per second", "output_throughput", ".1f"),
    ("p50 end-to-end latency (ms)", "median_e2el_ms", ".0f"),
    ("p95 end-to-end latency (ms)", "p95_e2el_ms", ".0f"),
    ("p99 end-to-end latency (ms)", "p99_e2el_ms", ".0f"),
    ("first attempts failed", "first_attempt_failures", "d"),
    ("retries", "retries", "d"),
]


def expect_phases_side_by_side(table: Locator, reports: dict[str, dict[str, Any]]) -> None:
    expect(table.locator("thead th")).to_have_text(["measure", *PHASES])
    for label, key, spec in MEASURES:
        expect(cells(table, label)).to_have_text([format(reports[p]["metrics"][key], spec) for p in PHASES])


def test_serving_phases_read_side_by_side_with_their_latency_failure_timeline_agreement_and_the_hosts_work(
    page: Page, coordinator: CoordinatorProcess
) -> None:
    a, b = host_agent(coordinator, "host-a"), host_agent(coordinator, "host-b")
    experiment = experiment_through_testing(coordinator, a, b)
    serve(coordinator, experiment, a, b)
    reports = {phase: phase_report(phase) for phase in PHASES}
    first_single = phase_report("single", pace=1.3)  # recorded first; the rerun's record is the one shown
    operate(coordinator, f"/api/experiments/{experiment}/advance", {})
    benchmark(a, first_single)
    page.goto(f"/experiments/{experiment}/serving")
    table = page.get_by_test_id("phases")
    expect(cells(table, "recorded")).to_contain_text(["UTC", "not run yet", "not run yet"])
    expect(cells(table, "requests per second")).to_have_text(
        [f"{first_single['metrics']['request_throughput']:.2f}", "", ""]
    )

    rerun = {"kind": "benchmark", "arm": "clean-pair", "spec": {"phase": "single"}}
    operate(coordinator, f"/api/experiments/{experiment}/jobs", rerun)
    benchmark(a, reports["single"])
    operate(coordinator, f"/api/experiments/{experiment}/advance", {})
    benchmark(a, reports["pair"])
    operate(coordinator, f"/api/experiments/{experiment}/advance", {})
    failure = a.take("benchmark")
    a.printed(failure, 0, {"event": "stop-replica", "after": reports["failure"]["stop_after"]})
    page.goto(f"/experiments/{experiment}/jobs")
    running = page.get_by_role("row", name="benchmark clean-pair, failure phase")
    expect(running.get_by_test_id("took")).to_contain_text("running for")
    stop = b.take("replica-stop")  # the coordinator stopped rank 1's replica on the benchmark's word
    b.finish(stop, result={"stopped": True})
    time.sleep(2.1)  # long enough that the phase's duration reads as seconds
    a.finish(failure, serving=[{"phase": "failure", "report": reports["failure"]}])
    operate(coordinator, f"/api/experiments/{experiment}/advance", {})
    a.finish(a.take("replica-stop"), result={"stopped": True})

    page.goto(f"/experiments/{experiment}/serving")
    table = page.get_by_test_id("phases")
    expect_phases_side_by_side(table, reports)
    expect(cells(table, "recorded").first).to_contain_text("the latest of 2 records")
    assert reports["single"]["metrics"]["request_throughput"] != first_single["metrics"]["request_throughput"]
    expect(page.get_by_test_id("latency").locator("svg")).to_be_visible()
    expect(page.get_by_test_id("latency").locator("figcaption")).to_contain_text("latency of every completed request")
    stopped = reports["failure"]
    expect(page.get_by_test_id("stop")).to_contain_text(
        f"stopped after {stopped['stop_after']} completions; the client saw it leave {stopped['stop_seen']:.2f} s"
    )
    expect(page.get_by_test_id("stop")).to_contain_text("1 first attempt failed, 1 retry, 0 lost")
    timeline = page.get_by_test_id("failure-timeline")
    expect(timeline.locator("svg")).to_be_visible()
    expect(timeline.locator("figcaption")).to_contain_text(f"Each of the {len(stopped['completions'])} requests")
    page.get_by_text("Every attempt of the failure phase").click()
    attempts = page.get_by_test_id("attempts").locator("tbody tr")
    expect(attempts).to_have_count(len(stopped["attempts"]))
    retried = attempts.filter(has_text="503")
    expect(retried).to_contain_text("the replica is shutting down")
    request = retried.locator("th").inner_text()
    expect(attempts.filter(has=page.locator("th", has_text=re.compile(f"^{request}$")))).to_have_count(2)
    screenshot(page, "serving")

    report = json.loads(REPORT.read_text()) | {"serving": serving_section(reports)}
    off_thread(record_report, coordinator.database_url, coordinator.home, experiment, report)
    page.goto(f"/experiments/{experiment}/report")
    expect_phases_side_by_side(page.get_by_test_id("serving-phases"), reports)
    ratio = report["serving"]["pair_over_single_request_throughput"]
    expect(page.get_by_test_id("pair-over-single")).to_contain_text(
        f"Two replicas serve {ratio:.2f}\N{MULTIPLICATION SIGN}"
    )
    summary = report["serving"]["failure"]
    facts = page.get_by_test_id("failure")
    expect(fact(facts, "Replica stopped after")).to_have_text(f"{summary['stopped_after_completions']} completions")
    seen = f"{summary['stop_seen_at_seconds']:.2f} s after the phase started"
    expect(fact(facts, "The client saw it leave")).to_have_text(seen)
    left = str(summary["requests_started_after_one_replica_left"])
    expect(fact(facts, "Requests started after one replica left")).to_have_text(left)
    expect(fact(facts, "First attempts failed")).to_have_text(str(summary["first_attempt_failures"]))
    expect(fact(facts, "Retries")).to_have_text(str(summary["retries"]))
    expect(fact(facts, "Requests lost")).to_have_text(str(summary["lost"]))
    agreement = page.get_by_test_id("agreement").locator("li")
    expect(agreement).to_have_count(3)
    for line, (phase, found) in zip(agreement.all(), report["serving"]["agreement"].items(), strict=True):
        expect(line).to_contain_text(
            f"{phase}: identical to the evaluation: {found['identical']} of {found['tasks']} answers, "
            f"token agreement {100 * found['token_agreement']:.1f}%, "
            f"correct {found['correct']} (evaluation: {found['expected_correct']})"
        )
    expect(agreement.last).to_contain_text("First difference: task")
    expect(page.locator("figure.chart svg")).to_have_count(5)  # the report's four, and serving latency by phase
    screenshot(page, "report-serving")

    page.goto(f"/experiments/{experiment}/jobs")
    finished = page.get_by_role("table").filter(has_text="took")
    pair = finished.get_by_role("row", name="train clean-pair")
    expect(pair.get_by_test_id("hosts")).to_have_text("host-a (rank 0), host-b (rank 1)")
    for name, host in [
        ("replica-start clean-pair, rank 0", "host-a"),
        ("replica-start clean-pair, rank 1", "host-b"),
        ("benchmark clean-pair, pair phase", "host-a"),
        ("replica-stop clean-pair, rank 1", "host-b"),
        ("replica-stop clean-pair, rank 0", "host-a"),
    ]:
        expect(finished.get_by_role("row", name=name).get_by_test_id("hosts")).to_have_text(host)
    expect(finished.get_by_role("row", name="benchmark clean-pair, single phase")).to_have_count(2)
    started, ended = job_times(coordinator, str(failure.job_id))
    took = (ended - started).total_seconds()
    assert took >= 2
    row = finished.get_by_role("row", name="benchmark clean-pair, failure phase")
    expect(row.get_by_test_id("took")).to_have_text(duration(took))
    hosts = page.get_by_test_id("host-timeline")
    expect(hosts.locator("svg")).to_be_visible()
    counts = attempts_by_host(coordinator, experiment)
    expect(hosts.locator("figcaption")).to_contain_text(
        f"host-a {counts['host-a']} attempts, host-b {counts['host-b']} attempts"
    )
    screenshot(page, "jobs-timeline")


def test_a_report_in_another_shape_is_named_and_linked_not_an_error(
    page: Page, coordinator: CoordinatorProcess
) -> None:
    experiment = experiment_through_testing(
        coordinator, host_agent(coordinator, "host-a"), host_agent(coordinator, "host-b")
    )
    operate(coordinator, f"/api/experiments/{experiment}/serving", SERVED)
    reports = {phase: phase_report(phase) for phase in PHASES}
    report = json.loads(REPORT.read_text()) | {"serving": serving_section(reports, with_agreement=False)}
    off_thread(record_report, coordinator.database_url, coordinator.home, experiment, report)
    response = page.goto(f"/experiments/{experiment}/report")
    assert response is not None and response.status == 200
    problem = page.get_by_test_id("report-problem")
    expect(problem).to_contain_text("not in the shape this coordinator reads")
    expect(problem).to_contain_text("at `$.serving`")
    expect(problem.get_by_role("link", name="the report JSON")).to_have_attribute(
        "href", f"/api/experiments/{experiment}/report"
    )


def test_a_local_sgd_report_shows_its_own_verdict_the_bytes_per_arm_and_both_loss_curves(
    page: Page, coordinator: CoordinatorProcess
) -> None:
    agents = [host_agent(coordinator, f"host-{letter}") for letter in "abcd"]
    experiment = local_sgd_through_testing(coordinator, agents)
    report = json.loads(REPORT_LOCAL_SGD.read_text())
    off_thread(record_report, coordinator.database_url, coordinator.home, experiment, report)
    page.goto(f"/experiments/{experiment}/report")
    local = report["local_sgd"]
    expect(page.get_by_test_id("verdict")).to_have_text("PASSED" if local["verdict"]["passed"] else "NOT PASSED")
    test = local["noninferiority"]
    claim = page.get_by_test_id("noninferiority")
    expect(claim).to_contain_text(f"answers {test['wins']} right that {test['control']}")
    expect(claim).to_contain_text(f"p {test['p_value']:.3g}")
    communication = page.get_by_test_id("communication")
    for arm, row in local["communication"].items():
        cells = communication.get_by_role("row").filter(has_text=arm).get_by_role("cell")
        expect(cells.nth(1)).to_have_text(str(row["synchronizations"]))
        expect(cells.nth(2)).to_have_text(f"{row['theory_bytes_per_rank']:,.0f}")
    expect(page.get_by_text("Primary contract")).to_have_count(0)
    # Accuracy by family and by wording, both arms' loss curves, update times, and the bytes against the theory.
    expect(page.locator("figure svg")).to_have_count(5)
    expect(page.locator("figure").filter(has_text="Bytes each rank wrote")).to_be_visible()
    screenshot(page, "report-local-sgd")


def test_the_whole_log_downloads_as_text_and_ends_with_the_tail_the_page_shows(
    page: Page, coordinator: CoordinatorProcess
) -> None:
    experiment = create_experiment(coordinator)["id"]
    agent = host_agent(coordinator, "host-a")
    prepare = agent.take("prepare")
    printed = [f"prepared file {n} of 150" for n in range(150)]
    agent.printed(prepare, 0, *printed[:100])
    agent.printed(prepare, 1, *printed[100:])
    agent.finish(prepare, result={"prepared_identity": sha("prepared")})
    page.goto(f"/jobs/{prepare.job_id}")
    tail = page.get_by_test_id("log")
    expect(tail).to_contain_text(printed[-1])
    shown = tail.inner_text().splitlines()
    assert len(shown) == 80, "the page shows the last 80 lines"

    with page.expect_download() as started:
        page.get_by_test_id("log-download").click()
    download = started.value
    assert download.suggested_filename == f"prepare-{prepare.job_id}-attempt-1-rank-0.log"
    whole = Path(download.path()).read_bytes()
    href = page.get_by_test_id("log-download").get_attribute("href")
    assert href is not None
    response = coordinator.http.get(href)
    assert response.status_code == 200 and response.content == whole
    assert response.headers["content-type"].startswith("text/plain")
    assert response.headers["content-disposition"].startswith("attachment;")
    # The truth apart from the page: every event the attempt recorded, as the API lists them.
    events = attempt_events(coordinator, prepare.attempt_id)
    lines = whole.decode().splitlines()
    assert len(lines) == len(events) > 150
    assert [line.split("output     ", 1)[1] for line in lines if " output     " in line] == printed
    assert lines[-80:] == shown, "the download ends with the tail the page shows"
    assert coordinator.http.get(f"/jobs/{prepare.job_id}/attempts/{uuid.uuid4()}/log").status_code == 404
    other = coordinator.get(f"/api/experiments/{experiment}/jobs")
    elsewhere = next(job["id"] for job in other if job["id"] != str(prepare.job_id))
    assert coordinator.http.get(f"/jobs/{elsewhere}/attempts/{prepare.attempt_id}/log").status_code == 404
    screenshot(page, "job-log")


def test_the_hosts_timeline_draws_a_new_attempt_without_reloading(page: Page, coordinator: CoordinatorProcess) -> None:
    experiment = create_experiment(coordinator)["id"]
    agent = host_agent(coordinator, "host-a")
    prepare = agent.take("prepare")
    agent.finish(prepare, result={"prepared_identity": sha("prepared")})  # autopilot queues the training
    page.goto(f"/experiments/{experiment}/jobs")
    caption = page.get_by_test_id("host-timeline").locator("figcaption")
    expect(caption).to_contain_text("host-a 1 attempt,")
    page.evaluate("window.notReloaded = true")
    train = agent.take("train")
    expect(caption).to_contain_text("host-a 2 attempts", timeout=30_000)
    expect(page.get_by_role("row", name=f"train {train.arm}")).to_contain_text("running")
    assert page.evaluate("window.notReloaded") is True
    screenshot(page, "jobs-timeline-live")


def test_an_operator_halts_an_experiment_after_confirming_and_no_one_else_can(
    page: Page, coordinator: CoordinatorProcess
) -> None:
    experiment = create_experiment(coordinator)["id"]
    page.goto(f"/experiments/{experiment}")
    expect(page.get_by_test_id("state")).to_have_text("committed")
    expect(page.get_by_role("button", name="Halt experiment")).to_have_count(0)
    # A post without an operator's session and its CSRF token halts nothing.
    forged = coordinator.http.post(f"/experiments/{experiment}/halt", data={"confirm": "yes"})
    assert forged.status_code in {303, 401, 403}, forged.status_code
    assert coordinator.get(f"/api/experiments/{experiment}")["state"] == "committed"
    # A signed-in reader sees no halt either, and its own session and CSRF token halt nothing.
    page.goto("/login")
    page.get_by_label("Operator or reader token").fill(
        off_thread(make_token, coordinator.database_url, "reader", "reader")
    )
    page.get_by_role("button", name="Sign in").click()
    page.goto(f"/experiments/{experiment}")
    expect(page.get_by_role("button", name="Halt experiment")).to_have_count(0)
    page.goto("/login")
    page.evaluate(
        """action => {
            const form = document.querySelector('form[action="/login"]');
            form.action = action;
            form.querySelector('[name=token]').remove();
            form.insertAdjacentHTML('beforeend', '<input type="hidden" name="confirm" value="yes">');
            form.submit();
        }""",
        f"/experiments/{experiment}/halt",
    )
    expect(page.get_by_role("alert")).to_contain_text("reads only")
    assert coordinator.get(f"/api/experiments/{experiment}")["state"] == "committed"

    sign_in(page, coordinator)
    page.goto(f"/experiments/{experiment}")
    page.get_by_role("button", name="Halt experiment").click()
    expect(page.get_by_role("heading", name="Halt local?")).to_be_visible()
    assert coordinator.get(f"/api/experiments/{experiment}")["state"] == "committed"  # nothing until confirmed
    screenshot(page, "confirm-halt")
    page.get_by_role("button", name="Halt experiment").click()
    expect(page.get_by_role("status")).to_contain_text("halted local")
    expect(page.get_by_test_id("state")).to_have_text("halted")
    assert coordinator.get(f"/api/experiments/{experiment}")["state"] == "halted"
    expect(page.get_by_role("button", name="Halt experiment")).to_have_count(0)  # a halted experiment is final
    changes = page.locator("ol.timeline")
    expect(changes).to_contain_text("halted by operator")
