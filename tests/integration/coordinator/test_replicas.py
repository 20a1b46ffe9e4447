"""Serving jobs an operator queues by REST: each runs on its replica's host, a replica is started only where none
is starting or running and stopped only where one runs, and a malformed spec is refused with nothing queued."""

from __future__ import annotations

from typing import Any

import httpx

from experiment import wire
from tests.integration.coordinator.support import Api
from tests.integration.coordinator.test_lifecycle import refused
from tests.support.agent import FakeAgent
from tests.support.scenarios import experiment_through_testing, select_and_advance, sha, trained_experiment


def _serving(api: Api) -> tuple[str, dict[str, FakeAgent]]:
    """A tested experiment with its serving commitment (a: the pair's rank 0, b: rank 1); its replica starts, queued
    with the test evaluations, are still queued."""
    agents = {"a": api.agent("a"), "b": api.agent("b")}
    experiment_id = experiment_through_testing(api, agents["a"], agents["b"])
    served = api.operator_post(
        f"/api/experiments/{experiment_id}/serving", {"arm": "clean-pair", "model_identity": sha("clean-pair")}
    )
    assert served.status_code == 201, served.text
    return experiment_id, agents


def _queue(api: Api, experiment_id: str, kind: str, spec: dict[str, Any], arm: str = "clean-pair") -> httpx.Response:
    return api.operator_post(f"/api/experiments/{experiment_id}/jobs", {"kind": kind, "arm": arm, "spec": spec})


def _claim_on(agents: dict[str, FakeAgent], name: str, kind: str) -> wire.Assignment:
    other = next(agent for n, agent in agents.items() if n != name)
    assert other.claim() is None  # pinned to its host
    job = agents[name].claim()
    assert job is not None and job.kind == kind, job
    return job


def test_replicas_start_with_the_test_evaluations_and_the_benchmark_waits_for_the_serving_commitment(
    api: Api,
) -> None:
    a, b = api.agent("a"), api.agent("b")
    experiment_id = str(trained_experiment(api, a, b)["id"])
    refused(_queue(api, experiment_id, "replica-start", {"rank": 0}), "replica-requires-committed-selection")
    select_and_advance(api, experiment_id)
    queued = api.get(f"/api/experiments/{experiment_id}/jobs")
    order = [(job["kind"], job["role"] or job["spec"].get("rank")) for job in queued if job["state"] == "queued"]
    # The four test evaluations first, so a host evaluates before it starts its replica.
    assert order == [("evaluate", "test")] * 4 + [("replica-start", 0), ("replica-start", 1)], order

    start = b.take("replica-start")  # before the tests end: the replica reads the selection only
    assert start.spec["rank"] == 1
    result = {"probe_url": "http://b:9000", "replica_url": "http://127.0.0.1:8000", "rank": 1}
    b.finish(start, result=result | {"model_identity": sha("clean-pair")})
    assert api.get(f"/api/experiments/{experiment_id}")["state"] == "selected"
    refused(_queue(api, experiment_id, "benchmark", {"phase": "single"}), "serving-requires-serving-commitment")


def test_an_operator_stops_and_starts_a_replica_on_its_own_host(api: Api) -> None:
    experiment_id, agents = _serving(api)
    assert agents["a"].take("replica-start").spec["rank"] == 0  # rank 0's, left starting
    refused(_queue(api, experiment_id, "replica-stop", {"rank": 1}), "replica-not-running")  # starting
    refused(_queue(api, experiment_id, "replica-start", {"rank": 1}), "replica-running")  # starting
    start = _claim_on(agents, "b", "replica-start")
    assert start.spec["rank"] == 1
    refused(_queue(api, experiment_id, "replica-stop", {"rank": 1}), "replica-not-running")  # not up yet
    result = {"probe_url": "http://b:9000", "replica_url": "http://127.0.0.1:8000", "rank": 1}
    agents["b"].finish(start, result=result | {"model_identity": sha("clean-pair")})
    refused(_queue(api, experiment_id, "replica-start", {"rank": 1}), "replica-running")

    stop = _queue(api, experiment_id, "replica-stop", {"rank": 1})
    assert stop.status_code == 201 and stop.json()["spec"] == {"rank": 1}, stop.text
    refused(_queue(api, experiment_id, "replica-stop", {"rank": 1}), "replica-not-running")  # already asked
    job = _claim_on(agents, "b", "replica-stop")
    agents["b"].finish(job, result={"stopped": True})
    # Stopped: the benchmark that needs it is refused, and the rank may be started again.
    refused(_queue(api, experiment_id, "benchmark", {"phase": "pair"}), "benchmark-requires-replicas")
    assert _queue(api, experiment_id, "replica-start", {"rank": 1}).status_code == 201


def test_malformed_serving_jobs_are_refused_and_nothing_is_queued(api: Api) -> None:
    experiment_id, _ = _serving(api)
    jobs = f"/api/experiments/{experiment_id}/jobs"
    before = api.get(jobs)
    for spec in ({}, {"rank": 2}, {"rank": "1"}, {"rank": True}, {"rank": 1.0}, {"rank": 0, "port": 80}):
        refused(_queue(api, experiment_id, "replica-start", spec), "serving-spec")
    for spec in ({}, {"phase": "double"}, {"phase": "single", "endpoints": ["http://elsewhere:9000"]}):
        refused(_queue(api, experiment_id, "benchmark", spec), "serving-spec")
    refused(_queue(api, experiment_id, "replica-start", {"rank": 0}, arm="damaged-single"), "damaged-arm-never-served")
    assert api.get(jobs) == before
