"""One operator action per phase: advance queues the next stage, refuses while one runs, and pins the jobs
of a trained arm to the host holding its checkpoint; autopilot does the same on its own."""

from __future__ import annotations

import time
from typing import Any

from tests.integration.coordinator.support import FINAL_STEP, LOCAL_PLAN, Api, bearer, sha, train_result
from tests.integration.coordinator.test_lifecycle import refused


def _advance(api: Api, experiment_id: str) -> str:
    response = api.operator_post(f"/api/experiments/{experiment_id}/advance", {})
    assert response.status_code == 200, response.text
    action: str = response.json()["action"]
    return action


def _finish_all(api: Api, tokens: dict[str, str], kind: str, result: Any) -> dict[str, str]:
    """Claim and finish every queued ``kind`` job with whichever agent may take it; arm -> agent name."""
    ran: dict[str, str] = {}
    while True:
        claimed = next(((name, job) for name, token in tokens.items() if (job := api.claim(token))), None)
        if claimed is None:
            return ran
        name, job = claimed
        assert job["kind"] == kind, job
        if kind == "evaluate":
            assert api.evaluated(tokens[name], job).status_code == 200
        else:
            fields = result(job) if callable(result) else result
            assert api.finish(tokens[name], job, **fields).status_code == 200
        ran[str(job["arm"])] = name


def _train(api: Api, tokens: dict[str, str]) -> dict[str, str]:
    """The singles on a and b, then the pair as a gang (a: rank 0); arm -> the agent of rank 0."""
    a, b = tokens["a"], tokens["b"]
    singles = [api.claim(a), api.claim(b)]
    pair = [api.claim(a), api.claim(b)]
    for token, job in ((a, singles[0]), (b, singles[1]), (a, pair[0]), (b, pair[1])):
        assert job is not None and job["kind"] == "train"
        assert api.finish(token, job, **train_result(job["arm"]), binding=sha("binding")).status_code == 200
    return {str(singles[0]["arm"]): "a", str(singles[1]["arm"]): "b", "clean-pair": "a"}  # type: ignore[index]


def _verified(job: dict[str, Any]) -> dict[str, Any]:
    arm = job["arm"]
    return {
        "arm": arm,
        "model_identity": sha(arm),
        "path": f"runs/{arm}/rank-0/checkpoints/step-000128/model",
        "step": FINAL_STEP,
        "binding": sha("binding"),
        "receipt_sha256": sha(f"receipt {arm}"),
    }


def test_each_advance_queues_one_stage_and_trained_arms_stay_on_their_host(api: Api) -> None:
    tokens = {"a": api.agent("a"), "b": api.agent("b")}
    response = api.client.post(
        "/api/experiments",
        json={"plan_toml": LOCAL_PLAN.read_text(), "autopilot": False},
        headers={"Authorization": f"Bearer {api.operator}"},
    )
    assert response.status_code == 201 and not response.json()["autopilot"]
    experiment_id = response.json()["id"]
    refused(api.operator_post(f"/api/experiments/{experiment_id}/advance", {}), "phase-running")  # prepare queued
    _finish_all(api, tokens, "prepare", {"prepared_identity": sha("prepared")})
    assert api.get(f"/api/experiments/{experiment_id}")["state"] == "prepared"
    assert api.claim(tokens["a"]) is None  # autopilot off: nothing queued until the operator advances
    assert _advance(api, experiment_id) == "queued train clean-single, train damaged-single, train clean-pair"
    holders = _train(api, tokens)
    assert api.get(f"/api/experiments/{experiment_id}")["state"] == "trained"

    assert _advance(api, experiment_id).startswith("queued evaluate dev seed")
    ran = _finish_all(api, tokens, "evaluate", None)
    assert {arm: ran[arm] for arm in holders} == holders  # each trained arm evaluated where its checkpoint is
    assert _advance(api, experiment_id) == "queued select clean-single, select damaged-single, select clean-pair"
    assert _finish_all(api, tokens, "select", _verified) == holders
    experiment = api.get(f"/api/experiments/{experiment_id}")
    assert experiment["state"] == "selected"
    selection = next(e for e in api.get(f"/api/experiments/{experiment_id}/ledger") if e["kind"] == "selection")
    assert selection["identity"] == experiment["selection_identity"]
    assert set(selection["body"]["arms"]) == {"seed", "clean-single", "damaged-single", "clean-pair"}
    assert selection["body"]["arms"]["clean-pair"]["path"] == "runs/clean-pair/rank-0/checkpoints/step-000128/model"

    assert _advance(api, experiment_id).startswith("queued evaluate test seed")
    ran = _finish_all(api, tokens, "evaluate", None)
    assert {arm: ran[arm] for arm in holders} == holders
    assert _advance(api, experiment_id).startswith("serving committed: the clean-pair final checkpoint")
    _serve(api, experiment_id, tokens)
    assert _advance(api, experiment_id) == "queued report"
    # The coordinator runs the report itself; this evidence is not a real bundle, so the job fails and says why.
    deadline = time.monotonic() + 60
    while (report := _job(api, experiment_id, "report"))["state"] != "failed":
        assert report["state"] in {"queued", "leased", "running"} and time.monotonic() < deadline, report
        time.sleep(0.2)
    assert api.get(f"/api/experiments/{experiment_id}")["state"] == "serving"
    assert api.claim(tokens["a"]) is None and api.claim(tokens["b"]) is None  # agents never take report jobs
    # The operator may ask for the computation again, but never send a report of their own.
    path = f"/api/experiments/{experiment_id}/report"
    made_up = api.client.post(path, json={"verdict": "PASSED", "gain": 0.99}, headers=bearer(api.operator))
    assert made_up.status_code == 400 and "computes the report itself" in made_up.json()["detail"]
    again = api.operator_post(path, {})
    assert again.status_code == 400  # {} is a body too
    again = api.client.post(path, headers=bearer(api.operator))
    assert again.status_code == 201 and again.json()["kind"] == "report", again.text
    assert [j["state"] for j in api.get(f"/api/experiments/{experiment_id}/jobs") if j["kind"] == "report"][1] in {
        "queued",
        "running",
        "failed",
    }


def test_autopilot_queues_the_next_stage_when_the_last_job_succeeds(api: Api) -> None:
    tokens = {"a": api.agent("a"), "b": api.agent("b")}
    experiment_id = api.create_experiment()["id"]  # autopilot on by default
    prepare = api.claim(tokens["a"])
    assert prepare is not None and prepare["kind"] == "prepare"
    assert api.finish(tokens["a"], prepare, prepared_identity=sha("prepared")).status_code == 200
    _train(api, tokens)
    jobs = api.get(f"/api/experiments/{experiment_id}/jobs")
    assert [(j["kind"], j["role"], j["arm"]) for j in jobs if j["state"] == "queued"] == [
        ("evaluate", "dev", arm) for arm in ("seed", "clean-single", "damaged-single", "clean-pair")
    ]
    # A failed dev evaluation stops the autopilot: the operator reads the reason, then advances again.
    claimed = api.claim(tokens["a"])
    assert claimed is not None and claimed["arm"] == "seed"
    assert api.finish(tokens["a"], claimed, outcome="failed").status_code == 200
    _finish_all(api, tokens, "evaluate", None)
    assert not [j for j in api.get(f"/api/experiments/{experiment_id}/jobs") if j["kind"] == "select"]
    assert _advance(api, experiment_id) == "queued evaluate dev seed"
    retried = api.claim(tokens["b"])
    assert retried is not None and (retried["kind"], retried["arm"]) == ("evaluate", "seed")
    assert api.evaluated(tokens["b"], retried).status_code == 200
    assert [j["arm"] for j in api.get(f"/api/experiments/{experiment_id}/jobs") if j["kind"] == "select"] == [
        "clean-single",
        "damaged-single",
        "clean-pair",
    ]
    off = api.operator_post(f"/api/experiments/{experiment_id}/autopilot", {"on": False})
    assert off.status_code == 200 and off.json()["autopilot"] is False


def _job(api: Api, experiment_id: str, kind: str) -> dict[str, Any]:
    job: dict[str, Any] = next(j for j in api.get(f"/api/experiments/{experiment_id}/jobs") if j["kind"] == kind)
    return job


def _claim_pinned(api: Api, tokens: dict[str, str], name: str, kind: str) -> dict[str, Any]:
    other = next(token for n, token in tokens.items() if n != name)
    assert api.claim(other) is None  # pinned: only its host may claim it
    job = api.claim(tokens[name])
    assert job is not None and job["kind"] == kind, job
    return job


def _serve(api: Api, experiment_id: str, tokens: dict[str, str]) -> None:
    """Replicas on both hosts of the pair (a: rank 0, b: rank 1), the three benchmark phases on a, the failure
    phase's stop of b's replica on the benchmark's signal, then both replicas stopped."""
    assert _advance(api, experiment_id) == ("queued replica-start clean-pair rank 0, replica-start clean-pair rank 1")
    for name, rank in (("a", 0), ("b", 1)):
        job = api.claim(tokens[name])  # each host claims the replica of its own rank
        assert job is not None and job["kind"] == "replica-start"
        assert job["spec"]["rank"] == rank and len(job["spec"]["serving_token"]) == 64
        result = {"probe_url": f"http://{name}:9000", "replica_url": "http://127.0.0.1:8000", "rank": rank}
        assert api.finish(tokens[name], job, **result, model_identity=sha("clean-pair")).status_code == 200
    for phase, endpoints in (("single", ["http://a:9000"]), ("pair", ["http://a:9000", "http://b:9000"])):
        assert _advance(api, experiment_id) == f"queued benchmark clean-pair phase {phase}"
        job = _claim_pinned(api, tokens, "a", "benchmark")
        assert job["spec"]["endpoints"] == endpoints
        served = [{"phase": phase, "report": {"metrics": {"failed": 0}}}]
        assert api.report(tokens["a"], job, serving=served).status_code == 200
    assert _advance(api, experiment_id) == "queued benchmark clean-pair phase failure"
    failure = _claim_pinned(api, tokens, "a", "benchmark")
    assert api.claim(tokens["b"]) is None
    signal = {"lease_token": failure["lease_token"], "sequence": 0, "events": [{"kind": "stop-replica", "body": {}}]}
    sent = api.client.post(
        f"/api/attempts/{failure['attempt_id']}/events",
        json=signal,
        headers={
            "Authorization": f"Bearer {tokens['a']}",
            "Idempotency-Key": f"{failure['job_id']}:{failure['attempt_id']}:0",
        },
    )
    assert sent.status_code == 201, sent.text
    stop = _claim_pinned(api, tokens, "b", "replica-stop")  # the coordinator stops rank 1's replica mid-phase
    assert stop["spec"]["rank"] == 1
    assert api.finish(tokens["b"], stop, stopped=True).status_code == 200
    served = [{"phase": "failure", "report": {"metrics": {"failed": 0}}}]
    assert api.report(tokens["a"], failure, serving=served).status_code == 200
    assert _advance(api, experiment_id) == "queued replica-stop clean-pair rank 0"
    assert api.finish(tokens["a"], _claim_pinned(api, tokens, "a", "replica-stop"), stopped=True).status_code == 200
