"""Published reads: step journals and resource samples per job and attempt, every answer with its filters,
serving results and the recorded report; all public unless switched off."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    steps = api.get(f"/api/attempts/{job.attempt_id}/measurements?kind=step")
    assert [(m["kind"], m["position"], m["body"]["loss"]) for m in steps] == [("step", 1, 1.0), ("step", 2, 0.5)]
    every = api.get(f"/api/jobs/{job.job_id}/measurements")
    assert [(m["kind"], m["position"], m["rank"]) for m in every] == [
        ("resources", 0, 0),
        ("resources", 1, 0),
        ("step", 1, 0),
        ("step", 2, 0),
    ]
    assert api.client.get(f"/api/jobs/{job.job_id}/measurements?kind=weather").status_code == 400


def test_failed_attempt_keeps_its_journal_but_may_not_publish_answers(api: Api) -> None:
    a = api.agent("a")
    prepared_experiment(api, a)
    job = a.claim()
    assert job is not None
    refused = rejection(a.finish, job, outcome="failed", answers=[answer(0, True)])
    assert refused.status_code == 400 and "succeeded result only" in refused.detail
    a.finish(job, outcome="failed", journal=[_step(1)])
    assert [m["position"] for m in api.get(f"/api/attempts/{job.attempt_id}/measurements")] == [1]


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
    second = api.get(f"{path}?role=test&arm=seed&limit=5&offset=10")
    assert [x["answer"]["index"] for x in second["items"]] == [10, 11]
    wrong = api.get(f"{path}?arm=seed&correct=false")["items"]
    assert all(not x["answer"]["check"]["correct"] for x in wrong) and len(wrong) > 0
    sort_v2 = api.get(f"{path}?family=sort&variant=2")["items"]
    assert sort_v2 and all((x["answer"]["family"], x["answer"]["variant"]) == ("sort", 2) for x in sort_v2)
    assert api.get(f"{path}?role=dev")["total"] == 0
    assert api.client.get(f"{path}?limit=0").status_code == 400
    assert api.client.get(f"{path}?family=poetry").status_code == 400


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
