"""Benchmark phases against two real vLLM replicas: single and pair answer alike, and a replica stopped in the
middle of the failure phase loses no request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from experiment.learning import evaluation
from tests.integration.serving.conftest import WORKLOAD
from tests.integration.serving.support import EventProcess, Fleet, Trained, needs_vllm, serving_env
from tests.support import ROOT

pytestmark = [pytest.mark.slow, needs_vllm]


def _benchmark(home: Path, token: str, output: Path, phase: str, endpoints: list[str], *extra: str) -> EventProcess:
    args = ["benchmark", "--phase", phase, "--home", str(home), "--output", str(output), *extra]
    for endpoint in endpoints:
        args += ["--endpoint", endpoint]
    return EventProcess(args, token, output.with_suffix(".log"))


def _outputs(result: dict[str, Any]) -> dict[str, list[int]]:
    return {c["task_id"]: c["output_ids"] for c in result["completions"]}


def test_single_and_pair_phases_answer_every_request_as_the_evaluation_did(
    pair: list[str], trained: Trained, serving_token: str, tmp_path: Path
) -> None:
    serving_home = trained.home
    results = {}
    for phase, endpoints in (("single", pair[:1]), ("pair", pair)):
        output = tmp_path / f"{phase}.json"
        run = _benchmark(serving_home, serving_token, output, phase, endpoints)
        done = run.wait_for_event("benchmarked", 600)
        assert run.wait(60) == 0
        results[phase] = json.loads(output.read_bytes())
        assert done["completed"] == WORKLOAD and done["failed"] == 0
        progress = [e["completed"] for e in run.events if e["event"] == "benchmark"]
        assert progress == list(range(1, WORKLOAD + 1))
    pair_result = results["pair"]
    assert {c["endpoint"] for c in pair_result["completions"]} == set(pair)  # round robin reached both
    assert pair_result["models"] == [trained.identity]
    metrics = pair_result["metrics"]
    assert metrics["completed"] == WORKLOAD and metrics["retries"] == 0 and metrics["cache_hits"] == 0
    assert metrics["request_throughput"] == pytest.approx(WORKLOAD / metrics["duration"], rel=1e-3)
    assert metrics["mean_e2el_ms"] > 0 and metrics["median_e2el_ms"] <= metrics["p99_e2el_ms"]
    assert len(pair_result["attempts"]) == WORKLOAD
    # Every answer, in both phases, is the HF evaluation's answer from the same checkpoint.
    _summary, recorded, _ = evaluation.read_answers(trained.reference)
    truth = {a.id: a.output_ids for a in recorded}
    for result in results.values():
        assert _outputs(result) == {task: truth[task] for task in result["workload"]["task_ids"]}
        assert result["metrics"]["correct"] == sum(a.check.correct for a in recorded[:WORKLOAD])


def test_failure_phase_loses_no_request(
    pair: list[str], fleet: Fleet, serving_home: Path, serving_token: str, tmp_path: Path
) -> None:
    output = tmp_path / "failure.json"
    stopped = fleet.served[1]
    run = _benchmark(serving_home, serving_token, output, "failure", pair, "--stop-after", "4")
    signal_event = run.wait_for_event("stop-replica", 600)
    assert signal_event["completed"] == 4
    assert stopped.replica is not None
    assert stopped.replica.terminate() == 0  # as the agent cancels a replica job: SIGTERM, forwarded to vLLM
    assert stopped.replica.wait_for_event("stopped", 5)["reason"] == "SIGTERM"
    done = run.wait_for_event("benchmarked", 600)
    assert run.wait(60) == 0
    result = json.loads(output.read_bytes())
    metrics = result["metrics"]
    assert done["failed"] == metrics["failed"] == 0
    assert metrics["completed"] == WORKLOAD
    assert result["stop_after"] == 4
    # New requests waited from the announcement until the client saw the replica leave; from then on every
    # request went to the other replica, and whatever was in flight on the stopped one was answered or retried.
    seen = result["stop_seen"]
    assert seen is not None
    announced = sorted(c["ended"] for c in result["completions"])[3]
    after = [a for a in result["attempts"] if a["started"] >= seen]
    assert all(a["endpoint"] == pair[0] and a["status"] == 200 for a in after)
    concurrency = result["workload"]["concurrency"]
    assert len({a["request_id"] for a in after}) >= WORKLOAD - 4 - concurrency
    assert not [a for a in result["attempts"] if announced < a["started"] < seen and a["attempt"] == 1]
    failed = [a for a in result["attempts"] if a["status"] != 200]
    assert all(a["endpoint"] == pair[1] for a in failed)
    for attempt in failed:  # each was retried, with the same request id, on the other replica
        retried = [
            a
            for a in result["attempts"]
            if a["request_id"] == attempt["request_id"] and a["attempt"] == attempt["attempt"] + 1
        ]
        assert len(retried) == 1 and retried[0]["status"] == 200 and retried[0]["endpoint"] == pair[0]
    assert metrics["retries"] == len(failed) == metrics["first_attempt_failures"]
    assert any(e["event"] == "endpoint-down" and e["endpoint"] == pair[1] for e in run.events)
    assert [e["at"] for e in run.events if e["event"] == "stop-seen"] == [seen]


def test_benchmark_refuses_an_existing_output(serving_home: Path, serving_token: str, tmp_path: Path) -> None:
    output = tmp_path / "taken.json"
    output.write_text("{}\n")
    args = ["benchmark", "--phase", "single", "--home", str(serving_home), "--endpoint", "http://127.0.0.1:9"]
    done = subprocess.run(
        [sys.executable, "-m", "experiment.cli", *args, "--output", str(output)],
        cwd=ROOT,
        env=serving_env(serving_token),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "already exists" in done.stderr
    assert output.read_text() == "{}\n"
