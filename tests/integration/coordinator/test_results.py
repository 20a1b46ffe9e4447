"""Published reads: step journals and resource samples per job and attempt, every answer with its filters,
serving results and the recorded report; all public unless switched off."""

from __future__ import annotations

import csv
import datetime
import io
from collections.abc import Callable
from typing import Any

from experiment import wire
from server.settings import Settings
from tests.integration.coordinator.support import Api, running
from tests.support.agent import FakeAgent, answer, rejection
from tests.support.database import record_report
from tests.support.scenarios import (
    bearer,
    prepared_experiment,
    select_and_advance,
    sha,
    train_result,
    trained_experiment,
)


def _step(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "positions": [2 * step, 2 * step + 1],
        "local_positions": [2 * step],
        "loss": 1.0 / step,
        "learning_rate": 0.001,
        "gradient_norm": 0.5,
        "targets": 10,
        "weighted_targets": 12,
        "documents": 2,
        "seconds": 0.1,
    }


def _sample(seconds: float) -> dict[str, Any]:
    return {"seconds": seconds, "rss_bytes": 1 << 20, "cpu_user_seconds": 1.0, "cpu_system_seconds": 0.1, "threads": 4}


def _steps(api: Api, path: str) -> list[tuple[str, int, Any]]:
    return [
        (m["kind"], m.get("step"), m["record"]["loss"] if m["kind"] == "step" else m["index"])
        for m in api.get(path)["items"]
    ]


def test_step_journal_and_resource_samples_are_listed_per_attempt_and_job(api: Api) -> None:
    a = api.agent("a")
    prepared_experiment(api, a)
    job = a.claim()
    assert job is not None and job.kind == "train" and job.arm is not None
    a.finish(
        job,
        result=train_result(job.arm),
        journal=[_step(2), _step(1)],
        resource_samples=[_sample(0.0), _sample(1.0)],
    )
    steps = _steps(api, f"/api/attempts/{job.attempt_id}/measurements?kind=step")
    assert steps == [("step", 1, 1.0), ("step", 2, 0.5)]
    every = api.get(f"/api/jobs/{job.job_id}/measurements")["items"]
    assert [(m["kind"], m["step"], m.get("index"), m["rank"]) for m in every] == [
        ("step", 1, None, 0),
        ("step", 2, None, 0),
        ("resources", None, 0, 0),  # a sample only the result carried: the update it was taken in is not known
        ("resources", None, 1, 0),
    ]
    assert every[2]["sample"] == _sample(0.0) and every[0]["record"] == _step(1) | {"written_bytes": 0}
    assert api.client.get(f"/api/jobs/{job.job_id}/measurements?kind=weather").status_code == 400


def _step_event(step: int, at: str) -> wire.Event:
    body = {"event": "step", "arm": "clean-single", "rank": 0, "done": step, "total": 2, **_step(step)}
    return wire.Event("step", body, datetime.datetime.fromisoformat(at))


def _sample_event(index: int, step: int, at: str) -> wire.Event:
    body = {"event": "resources", "arm": "clean-single", "rank": 0, "step": step, "index": index, **_sample(index)}
    return wire.Event("resources", body, datetime.datetime.fromisoformat(at))


def test_a_running_attempts_measurements_are_readable_as_its_events_arrive_and_its_result_adds_the_rest(
    api: Api,
) -> None:
    a = api.agent("a")
    prepared_experiment(api, a)
    job = a.claim()
    assert job is not None and job.arm is not None
    a.start(job)
    first = (
        wire.Event("step", {"event": "step", "done": 1, "total": 2}),  # a progress line alone: no measurement
        _step_event(1, "2026-12-05T10:00:01+00:00"),
        _sample_event(0, 1, "2026-12-05T10:00:01.5+00:00"),
    )
    a.events(job, 0, *first)
    path = f"/api/jobs/{job.job_id}/measurements"
    live = api.get(path)["items"]
    assert [(m["kind"], m["step"], m["at"]) for m in live] == [
        ("step", 1, "2026-12-05T10:00:01Z"),
        ("resources", 1, "2026-12-05T10:00:01.500000Z"),
    ]
    assert api.get(f"/api/attempts/{job.attempt_id}")["state"] == "running"
    a.events(job, 0, *first)  # the same batch again (a lost reply): recorded once
    a.events(job, 1, _step_event(1, "2026-12-05T10:00:03+00:00"))  # a step printed twice: its first stands
    a.events(job, 2, _step_event(2, "2026-12-05T10:00:02+00:00"), _sample_event(1, 2, "2026-12-05T10:00:02+00:00"))
    assert len(api.get(path)["items"]) == 4

    other = dict(_step(2), loss=9.0)
    refused = rejection(a.finish, job, result=train_result(job.arm), journal=[_step(1), other])
    assert refused.status_code == 400 and "step 2 differs from the one its events reported" in refused.detail
    assert len(api.get(path)["items"]) == 4
    a.finish(
        job,
        result=train_result(job.arm),
        journal=[_step(1), _step(2)],
        resource_samples=[_sample(0), _sample(1), _sample(2)],
    )
    final = api.get(path)["items"]
    assert [(m["kind"], m["step"], m.get("index")) for m in final] == [
        ("step", 1, None),
        ("resources", 1, 0),
        ("step", 2, None),
        ("resources", 2, 1),
        ("resources", None, 2),  # the last sample, which only the result carried
    ]
    assert final[:4] == live + final[2:4]  # nothing recorded while it ran changed


def test_long_listings_page_with_the_cursor_each_page_gives_and_refuse_any_other(api: Api) -> None:
    a = api.agent("a")
    prepared_experiment(api, a)
    job = a.claim()
    assert job is not None and job.arm is not None
    samples = [_sample(float(i)) for i in range(7)]
    a.finish(job, result=train_result(job.arm), journal=[_step(1), _step(2)], resource_samples=samples)
    path = f"/api/jobs/{job.job_id}/measurements"
    whole = api.get(path)["items"]
    walked, cursor, pages = [], None, 0
    while True:
        page = api.get(f"{path}?limit=2" + (f"&after={cursor}" if cursor else ""))
        walked += page["items"]
        pages += 1
        cursor = page["next"]
        if cursor is None:
            break
    assert walked == whole and pages == 5 and len(whole) == 9
    first = api.get(f"{path}?limit=2")["next"]
    events = f"/api/attempts/{job.attempt_id}/events"
    for bad, reason in (
        ("not-a-cursor", "is not a cursor"),
        (first[:-2] + "AA", "names no row of this listing"),
        (api.get(f"{events}?limit=1")["next"], "names no row of this listing"),  # an events cursor
    ):
        refused = api.client.get(f"{path}?after={bad}")
        assert refused.status_code == 400 and reason in refused.json()["detail"], refused.text
    kinds = [e["kind"] for e in api.get(events)["items"]]
    followed, cursor = [], None
    while True:
        page = api.get(f"{events}?limit=1" + (f"&after={cursor}" if cursor else ""))
        followed += [e["kind"] for e in page["items"]]
        if (cursor := page["next"]) is None:
            break
    assert followed == kinds and len(kinds) >= 2


def test_failed_attempt_keeps_its_journal_but_may_not_publish_answers(api: Api) -> None:
    a = api.agent("a")
    prepared_experiment(api, a)
    job = a.claim()
    assert job is not None
    refused = rejection(a.finish, job, outcome="failed", answers=[answer(0, True)])
    assert refused.status_code == 400 and "succeeded result only" in refused.detail
    a.finish(job, outcome="failed", journal=[_step(1)])
    assert [m["step"] for m in api.get(f"/api/attempts/{job.attempt_id}/measurements")["items"]] == [1]


def _evaluated(api: Api) -> tuple[str, FakeAgent]:
    """Test answers for all four arms: arm number k gets index i right when (i + k) % 3 != 0."""
    a, b = api.agent("a"), api.agent("b")
    experiment_id = trained_experiment(api, a, b)["id"]
    select_and_advance(api, experiment_id)
    families = ("lookup", "filter", "total", "sort")
    for k in range(4):
        agent, job = next((agent, job) for agent in (a, b) if (job := agent.claim("evaluate")) is not None)
        agent.evaluated(job, [answer(i, (i + k) % 3 != 0, families[i % 4], (i // 4) % 4) for i in range(12)])
    assert api.get(f"/api/experiments/{experiment_id}")["state"] == "tested"
    return experiment_id, a


def test_every_test_answer_is_published_with_filters_and_pages(api: Api) -> None:
    experiment_id, _ = _evaluated(api)
    path = f"/api/experiments/{experiment_id}/answers"
    everything = api.get(f"{path}?role=test&limit=1000")
    assert everything["total"] == 48 and len(everything["items"]) == 48
    assert {item["arm"] for item in everything["items"]} == {"seed", "clean-single", "damaged-single", "clean-pair"}
    seed = api.get(f"{path}?role=test&arm=seed&limit=5")
    assert seed["total"] == 12 and [x["answer"]["index"] for x in seed["items"]] == [0, 1, 2, 3, 4]
    second = api.get(f"{path}?role=test&arm=seed&limit=5&after={seed['next']}")
    assert [x["answer"]["index"] for x in second["items"]] == [5, 6, 7, 8, 9] and second["offset"] == 5
    third = api.get(f"{path}?role=test&arm=seed&limit=5&after={second['next']}")
    assert [x["answer"]["index"] for x in third["items"]] == [10, 11] and third["next"] is None
    wrong = api.get(f"{path}?arm=seed&correct=false")["items"]
    assert all(not x["answer"]["check"]["correct"] for x in wrong) and len(wrong) > 0
    sort_v2 = api.get(f"{path}?family=sort&variant=2")["items"]
    assert sort_v2 and all((x["answer"]["family"], x["answer"]["variant"]) == ("sort", 2) for x in sort_v2)
    assert api.get(f"{path}?role=dev")["total"] == 0
    assert api.client.get(f"{path}?limit=0").status_code == 400
    assert api.client.get(f"{path}?family=poetry").status_code == 400


def _csv(api: Api, path: str) -> list[dict[str, str]]:
    response = api.client.get(path)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/csv")
    return list(csv.DictReader(io.StringIO(response.text)))


def test_answers_come_as_csv_with_the_json_routes_filters(api: Api) -> None:
    experiment_id, _ = _evaluated(api)
    path = f"/api/experiments/{experiment_id}/answers"
    for query in ("role=test", "role=test&arm=seed&correct=false", "family=sort&variant=2"):
        recorded = api.get(f"{path}?{query}&limit=1000")["items"]
        rows = _csv(api, f"{path}.csv?{query}")
        assert [(r["arm"], r["task_id"], r["correct"], r["text"]) for r in rows] == [
            (x["arm"], x["answer"]["id"], str(x["answer"]["check"]["correct"]), x["answer"]["text"]) for x in recorded
        ]
        assert [int(r["output_tokens"]) for r in rows] == [len(x["answer"]["output_ids"]) for x in recorded]
    assert api.client.get(f"{path}.csv?family=poetry").status_code == 400


def test_measurements_come_as_csv_a_row_each_with_its_kinds_columns(api: Api) -> None:
    a = api.agent("a")
    prepared_experiment(api, a)
    job = a.claim()
    assert job is not None and job.arm is not None
    a.finish(job, result=train_result(job.arm), journal=[_step(1), _step(2)], resource_samples=[_sample(0.5)])
    measured = api.get(f"/api/jobs/{job.job_id}/measurements")["items"]
    rows = _csv(api, f"/api/jobs/{job.job_id}/measurements.csv")
    assert len(rows) == len(measured) > 0
    for row, item in zip(rows, measured, strict=True):
        assert (row["kind"], row["attempt_id"]) == (item["kind"], item["attempt_id"])
        if item["kind"] == "step":
            assert float(row["loss"]) == item["record"]["loss"] and row["rss_bytes"] == ""
        else:
            assert int(row["rss_bytes"]) == item["sample"]["rss_bytes"] and row["loss"] == ""


def test_answers_are_recorded_once_per_arm_and_role(api: Api) -> None:
    experiment_id, _ = _evaluated(api)
    a = api.agents["a"]
    queued = api.operator_post(
        f"/api/experiments/{experiment_id}/jobs", {"kind": "evaluate", "arm": "seed", "role": "test"}
    )
    assert queued.status_code == 201, queued.text
    job = a.claim("evaluate")
    assert job is not None
    again = rejection(a.evaluated, job)
    assert again.status_code == 409 and again.rule == "answers-recorded-once"


def test_serving_results_and_the_report_are_stored_and_read_back(api: Api) -> None:
    experiment_id, a = _evaluated(api)
    report_path = f"/api/experiments/{experiment_id}/report"
    missing = api.client.get(report_path)
    assert missing.status_code == 404 and "no recorded report" in missing.json()["detail"]
    serving = api.operator_post(
        f"/api/experiments/{experiment_id}/serving", {"arm": "clean-pair", "model_identity": sha("clean-pair")}
    )
    assert serving.status_code == 201
    jobs = f"/api/experiments/{experiment_id}/jobs"
    single = {"kind": "benchmark", "arm": "clean-pair", "spec": {"phase": "single"}}
    assert api.operator_post(jobs, single).status_code == 409  # no replica runs yet
    replica = a.claim()  # rank 0's replica, queued with the test evaluations: a holds the pair's rank 0
    assert replica is not None and replica.kind == "replica-start"
    started = {"probe_url": "http://a:9000", "replica_url": "http://127.0.0.1:8000", "rank": 0}
    a.finish(replica, result=started | {"model_identity": sha("clean-pair")})
    assert api.operator_post(jobs, single).status_code == 201
    job = a.claim()
    assert job is not None and job.kind == "benchmark" and job.spec["endpoints"] == ["http://a:9000"]
    assert len(job.spec["serving_token"]) == 64  # handed to the claiming agent only
    assert "serving_token" not in api.get(f"/api/jobs/{job.job_id}")["spec"]
    phases = [{"phase": "single", "report": {"requests": 100}}, {"phase": "failure", "report": {"lost": 0}}]
    a.finish(job, serving=phases)
    listed = api.get(f"/api/experiments/{experiment_id}/serving-results")
    assert [(r["phase"], r["report"]) for r in listed] == [(p["phase"], p["report"]) for p in phases]
    report = {"primary": {"verdict": {"passed": True}}, "accuracy": {"seed": 0.25}}
    assert api.home is not None
    record_report(api.url, api.home, experiment_id, report)  # as the coordinator's report job commits it
    assert api.get(report_path) == report


def test_published_reads_need_a_token_when_public_read_is_off(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    with running(make_settings(public_read=False)) as client:
        api = Api(client, database_url)
        experiment = api.create_experiment()
        for suffix in ("answers", "serving-results", "report", "evidence", "evidence.tar"):
            assert client.get(f"/api/experiments/{experiment['id']}/{suffix}").status_code == 401, suffix
        assert (
            client.get(f"/api/experiments/{experiment['id']}/answers", headers=bearer(api.operator)).status_code == 200
        )
        assert client.get(f"/api/blobs/{'a' * 64}").status_code == 401
