"""One operator action per phase: advance queues the next stage, refuses while one runs, and pins the jobs
of a trained arm to the host holding its checkpoint; autopilot does the same on its own."""

from __future__ import annotations

from typing import Any

from experiment import wire
from tests.integration.coordinator.support import Api
from tests.integration.coordinator.test_lifecycle import refused
from tests.support.agent import FakeAgent, rejection
from tests.support.scenarios import FINAL_STEP, LOCAL_PLAN, bearer, sha, train_result
from tests.support.waiting import wait_for


def _advance(api: Api, experiment_id: str) -> str:
    response = api.operator_post(f"/api/experiments/{experiment_id}/advance", {})
    assert response.status_code == 200, response.text
    action: str = response.json()["action"]
    return action


def _finish_all(agents: dict[str, FakeAgent], kind: str, result: Any) -> dict[str, str]:
    """Claim and finish every queued ``kind`` job with whichever agent may take it; arm -> agent name."""
    ran: dict[str, str] = {}
    while True:
        claimed = next(((name, job) for name, agent in agents.items() if (job := agent.claim(kind))), None)
        if claimed is None:
            return ran
        name, job = claimed
        assert job.kind == kind, job
        if kind == "evaluate":
            agents[name].evaluated(job)
        else:
            agents[name].finish(job, result=result(job) if callable(result) else result)
        ran[str(job.arm)] = name


def _train(agents: dict[str, FakeAgent]) -> dict[str, str]:
    """The singles on a and b, then the pair as a gang (a: rank 0); arm -> the agent of rank 0."""
    a, b = agents["a"], agents["b"]
    singles = [a.claim(), b.claim()]
    pair = [a.claim(), b.claim()]
    held: dict[str, str] = {}
    for name, job in (("a", singles[0]), ("b", singles[1]), ("a", pair[0]), ("b", pair[1])):
        assert job is not None and job.kind == "train", job
        agents[name].finish(job, result=train_result(str(job.arm)) | {"binding": sha("binding")})
        held.setdefault(str(job.arm), name)
    return held


def _verified(job: wire.Assignment) -> dict[str, Any]:
    arm = str(job.arm)
    candidate = {
        "arm": arm,
        "model_identity": sha(arm),
        "path": f"runs/{arm}/rank-0/checkpoints/step-000128/model",
        "step": FINAL_STEP,
        "binding": sha("binding"),
        "receipt_sha256": sha(f"receipt {arm}"),
    }
    return {"candidate": candidate}


def test_each_advance_queues_one_stage_and_trained_arms_stay_on_their_host(api: Api) -> None:
    agents = {"a": api.agent("a"), "b": api.agent("b")}
    response = api.client.post(
        "/api/experiments",
        json={"plan_toml": LOCAL_PLAN.read_text(), "autopilot": False},
        headers={"Authorization": f"Bearer {api.operator}"},
    )
    assert response.status_code == 201 and not response.json()["autopilot"]
    experiment_id = response.json()["id"]
    refused(api.operator_post(f"/api/experiments/{experiment_id}/advance", {}), "phase-running")  # prepare queued
    _finish_all(agents, "prepare", {"prepared_identity": sha("prepared")})
    assert api.get(f"/api/experiments/{experiment_id}")["state"] == "prepared"
    assert agents["a"].claim() is None  # autopilot off: nothing queued until the operator advances
    assert _advance(api, experiment_id) == "queued train clean-single, train damaged-single, train clean-pair"
    holders = _train(agents)
    assert api.get(f"/api/experiments/{experiment_id}")["state"] == "trained"

    assert _advance(api, experiment_id).startswith("queued evaluate dev seed")
    ran = _finish_all(agents, "evaluate", None)
    assert {arm: ran[arm] for arm in holders} == holders  # each trained arm evaluated where its checkpoint is
    assert _advance(api, experiment_id) == "queued select clean-single, select damaged-single, select clean-pair"
    select = agents["a"].claim()
    assert select is not None and select.kind == "select"
    seed_shaped = {"candidate": {"arm": select.arm, "model_identity": sha("seed files")}}  # no checkpoint named
    refusal = rejection(agents["a"].finish, select, result=seed_shaped)
    assert refusal.status_code == 400 and "path, step, binding and receipt" in refusal.detail, refusal
    agents["a"].finish(select, result=_verified(select))
    assert _finish_all(agents, "select", _verified) == {arm: holders[arm] for arm in holders if arm != select.arm}
    experiment = api.get(f"/api/experiments/{experiment_id}")
    assert experiment["state"] == "selected"
    selection = next(e for e in api.get(f"/api/experiments/{experiment_id}/ledger") if e["kind"] == "selection")
    assert selection["identity"] == experiment["selection_identity"]
    assert set(selection["body"]["arms"]) == {"seed", "clean-single", "damaged-single", "clean-pair"}
    assert selection["body"]["arms"]["clean-pair"]["path"] == "runs/clean-pair/rank-0/checkpoints/step-000128/model"

    tests = _advance(api, experiment_id)
    assert tests.startswith("queued evaluate test seed"), tests
    assert tests.endswith("replica-start clean-pair rank 0, replica-start clean-pair rank 1"), tests
    _start_replicas(agents)  # while the tests run: a replica needs the selection only
    assert api.get(f"/api/experiments/{experiment_id}")["state"] == "selected"
    ran = _finish_all(agents, "evaluate", None)
    assert {arm: ran[arm] for arm in holders} == holders
    assert _advance(api, experiment_id).startswith("serving committed: the clean-pair final checkpoint")
    _serve(api, experiment_id, agents)
    assert _advance(api, experiment_id) == "queued report"
    # The coordinator runs the report itself; this evidence is not a real bundle, so the job fails and says why.

    def report_failed() -> bool:
        report = _job(api, experiment_id, "report")
        assert report["state"] in {"queued", "leased", "running", "failed"}, report
        return report["state"] == "failed"

    wait_for(report_failed, 60, "the report job to fail")
    assert api.get(f"/api/experiments/{experiment_id}")["state"] == "serving"
    assert agents["a"].claim() is None and agents["b"].claim() is None  # agents never take report jobs
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
    agents = {"a": api.agent("a"), "b": api.agent("b")}
    experiment_id = api.create_experiment()["id"]  # autopilot on by default
    prepare = agents["a"].claim()
    assert prepare is not None and prepare.kind == "prepare"
    agents["a"].finish(prepare, result={"prepared_identity": sha("prepared")})
    _train(agents)
    jobs = api.get(f"/api/experiments/{experiment_id}/jobs")
    assert [(j["kind"], j["role"], j["arm"]) for j in jobs if j["state"] == "queued"] == [
        ("evaluate", "dev", arm) for arm in ("seed", "clean-single", "damaged-single", "clean-pair")
    ]
    # A failed dev evaluation stops the autopilot: the operator reads the reason, then advances again.
    claimed = agents["a"].claim()
    assert claimed is not None and claimed.arm == "seed"
    agents["a"].finish(claimed, outcome="failed")
    _finish_all(agents, "evaluate", None)
    assert not [j for j in api.get(f"/api/experiments/{experiment_id}/jobs") if j["kind"] == "select"]
    assert _advance(api, experiment_id) == "queued evaluate dev seed"
    retried = agents["b"].claim()
    assert retried is not None and (retried.kind, retried.arm) == ("evaluate", "seed")
    agents["b"].evaluated(retried)
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


def _claim_pinned(agents: dict[str, FakeAgent], name: str, kind: str) -> wire.Assignment:
    other = next(agent for n, agent in agents.items() if n != name)
    assert other.claim() is None  # pinned: only its host may claim it
    job = agents[name].claim()
    assert job is not None and job.kind == kind, job
    return job


def _start_replicas(agents: dict[str, FakeAgent]) -> None:
    """The replica-start jobs queued with the test evaluations, each claimed by the host of its rank."""
    for name, rank in (("a", 0), ("b", 1)):
        job = agents[name].claim("replica-start")
        assert job is not None and job.spec["rank"] == rank and len(job.spec["serving_token"]) == 64, job
        result = {"probe_url": f"http://{name}:9000", "replica_url": "http://127.0.0.1:8000", "rank": rank}
        agents[name].finish(job, result=result | {"model_identity": sha("clean-pair")})


def _serve(api: Api, experiment_id: str, agents: dict[str, FakeAgent]) -> None:
    """With both replicas running (a: rank 0, b: rank 1), the three benchmark phases on a, the failure phase's
    stop of b's replica on the benchmark's signal, then both replicas stopped."""
    for phase, endpoints in (("single", ["http://a:9000"]), ("pair", ["http://a:9000", "http://b:9000"])):
        assert _advance(api, experiment_id) == f"queued benchmark clean-pair phase {phase}"
        job = _claim_pinned(agents, "a", "benchmark")
        assert job.spec["endpoints"] == endpoints
        agents["a"].finish(job, serving=[{"phase": phase, "report": {"metrics": {"failed": 0}}}])
    assert _advance(api, experiment_id) == "queued benchmark clean-pair phase failure"
    failure = _claim_pinned(agents, "a", "benchmark")
    assert agents["b"].claim() is None
    agents["a"].printed(failure, 0, {"event": "stop-replica"})  # the benchmark's signal: stop a replica now
    stop = _claim_pinned(agents, "b", "replica-stop")  # the coordinator stops rank 1's replica mid-phase
    assert stop.spec["rank"] == 1
    agents["b"].finish(stop, result={"stopped": True})
    agents["a"].finish(failure, serving=[{"phase": "failure", "report": {"metrics": {"failed": 0}}}])
    assert _advance(api, experiment_id) == "queued replica-stop clean-pair rank 0"
    agents["a"].finish(_claim_pinned(agents, "a", "replica-stop"), result={"stopped": True})
