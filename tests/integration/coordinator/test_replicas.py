"""Serving jobs an operator queues by REST: each runs on its replica's host, a replica is started only where none
is starting or running and stopped only where one runs, and a malformed spec is refused with nothing queued."""

from __future__ import annotations

from typing import Any

import httpx

from tests.integration.coordinator.support import Api, experiment_through_testing, sha
from tests.integration.coordinator.test_lifecycle import refused


def _serving(api: Api) -> tuple[str, dict[str, str]]:
    """A tested experiment with its serving commitment (a: the pair's rank 0, b: rank 1)."""
    experiment_id, _ = experiment_through_testing(api)
    served = api.operator_post(
        f"/api/experiments/{experiment_id}/serving", {"arm": "clean-pair", "model_identity": sha("clean-pair")}
    )
    assert served.status_code == 201, served.text
    return experiment_id, {"a": api.agents["a"], "b": api.agents["b"]}


def _queue(api: Api, experiment_id: str, kind: str, spec: dict[str, Any], arm: str = "clean-pair") -> httpx.Response:
    return api.operator_post(f"/api/experiments/{experiment_id}/jobs", {"kind": kind, "arm": arm, "spec": spec})


def _claim_on(api: Api, tokens: dict[str, str], name: str, kind: str) -> dict[str, Any]:
    other = next(token for n, token in tokens.items() if n != name)
    assert api.claim(other) is None  # pinned to its host
    job = api.claim(tokens[name])
    assert job is not None and job["kind"] == kind, job
    return job


def test_an_operator_starts_and_stops_a_replica_on_its_own_host(api: Api) -> None:
    experiment_id, tokens = _serving(api)
    refused(_queue(api, experiment_id, "replica-stop", {"rank": 1}), "replica-not-running")
    assert _queue(api, experiment_id, "replica-start", {"rank": 1}).status_code == 201
    refused(_queue(api, experiment_id, "replica-start", {"rank": 1}), "replica-running")  # starting
    start = _claim_on(api, tokens, "b", "replica-start")
    assert start["spec"]["rank"] == 1
    refused(_queue(api, experiment_id, "replica-stop", {"rank": 1}), "replica-not-running")  # not up yet
    result = {"probe_url": "http://b:9000", "replica_url": "http://127.0.0.1:8000", "rank": 1}
    assert api.finish(tokens["b"], start, **result, model_identity=sha("clean-pair")).status_code == 200
    refused(_queue(api, experiment_id, "replica-start", {"rank": 1}), "replica-running")

    stop = _queue(api, experiment_id, "replica-stop", {"rank": 1})
    assert stop.status_code == 201 and stop.json()["spec"] == {"rank": 1}, stop.text
    refused(_queue(api, experiment_id, "replica-stop", {"rank": 1}), "replica-not-running")  # already asked
    job = _claim_on(api, tokens, "b", "replica-stop")
    assert api.finish(tokens["b"], job, stopped=True).status_code == 200
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
