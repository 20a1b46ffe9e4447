"""The probe in front of a real vLLM replica: the evaluation's answers, the retry cache, and every refusal."""

from __future__ import annotations

import shutil
import signal
import time
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest
from safetensors.torch import load_file, save_file

from experiment.learning import corpus, evaluation
from experiment.seed import seedmodel
from experiment.serving.agreement import CPU_IDENTITY_TASKS as IDENTITY_TASKS
from tests.integration.serving.conftest import STARTUP_SECONDS
from tests.integration.serving.support import TINY, EventProcess, Trained, needs_vllm
from tests.support.processes import free_port

pytestmark = [pytest.mark.slow, needs_vllm]


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _infer(url: str, token: str, request_id: str, task_id: str) -> httpx.Response:
    body = {"request_id": request_id, "task_id": task_id}
    return httpx.post(f"{url}/infer", json=body, headers=_auth(token), timeout=120)


def _dev(home: Path) -> list[corpus.TaskItem]:
    return corpus.load_prepared(home).task_items("dev")


def test_greedy_answers_equal_the_evaluation_of_the_same_checkpoint(
    probe_url: str, trained: Trained, serving_token: str
) -> None:
    """Every dev task of the workload, against the HF evaluation that answered it from the same checkpoint."""
    _summary, recorded, _ = evaluation.read_answers(trained.reference)
    tokenizer = seedmodel.load_tokenizer(TINY)
    assert sum(a.check.valid_json_object for a in recorded) > 0  # the trained model answers in the tasks' JSON
    for truth in recorded:
        reply = _infer(probe_url, serving_token, uuid.uuid4().hex, truth.id)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["output_ids"] == truth.output_ids, truth.id
        assert (
            answer["text"]
            == truth.text
            == tokenizer.decode(
                truth.output_ids[:-1] if truth.ended_with_eos else truth.output_ids, skip_special_tokens=False
            )
        )
        assert (answer["ended_with_eos"], answer["hit_token_limit"]) == (truth.ended_with_eos, truth.hit_token_limit)
        assert answer["check"] == msgspec.to_builtins(truth.check)
        assert answer["model"] == trained.identity
        assert answer["cached"] is False


def test_health_names_the_model_and_its_check_against_the_evaluation(
    probe_url: str, trained: Trained, serving_token: str
) -> None:
    reply = httpx.get(f"{probe_url}/health", headers=_auth(serving_token), timeout=10)
    assert reply.status_code == 200
    health = reply.json()
    assert health["model"] == trained.identity
    checked = health["identity"]
    assert checked["tasks"] == checked["identical"] == checked["same_outcome"] == IDENTITY_TASKS
    assert checked["matched_tokens"] == checked["expected_tokens"] > 0
    assert checked["first_difference"] is None


def test_a_probe_refuses_a_replica_of_a_checkpoint_vllm_misreads(
    trained: Trained, serving_token: str, tmp_path: Path
) -> None:
    """The defect this check exists for: the tied embedding saved as lm_head.weight. HF re-ties the pair on load;
    vLLM keeps the lm_head and builds its embedding from nothing, and every answer is padding, as in the run."""
    broken = tmp_path / "model"
    shutil.copytree(trained.model_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    assert seedmodel.load_model(broken).lm_head.weight.equal(seedmodel.load_model(trained.model_dir).lm_head.weight)
    port, probe_port = free_port(), free_port()
    replica_args = ["replica", "--model-dir", str(broken), "--served-model-name", trained.identity]
    served = EventProcess([*replica_args, "--port", str(port)], serving_token, tmp_path / "replica.log")
    args = ["probe", "--home", str(trained.home), "--model-dir", str(TINY), "--replica", f"http://127.0.0.1:{port}"]
    args += ["--expect", str(trained.reference), "--port", str(probe_port)]
    probe = EventProcess(args, serving_token, tmp_path / "probe.log")
    try:
        served.wait_for_event("healthy", STARTUP_SECONDS)
        assert probe.wait(300) == 2
    finally:
        probe.terminate()
        served.terminate()
    refusal = (tmp_path / "probe.log").read_text()
    first = evaluation.read_answers(trained.reference)[1][0]
    assert f"the replica's answer to dev task {first.id} (index 0) is only padding (96 x token id 0)" in refusal
    assert not any(event["event"] == "listening" for event in probe.events)  # it never served anything


def test_a_probe_still_checking_its_replica_stops_at_once(trained: Trained, serving_token: str, tmp_path: Path) -> None:
    """Until it serves, nothing holds a probe up: a stop while it waits for its replica ends it (as an agent stops a
    replica that is still starting)."""
    nowhere = f"http://127.0.0.1:{free_port()}"  # no replica ever answers there
    args = ["probe", "--home", str(trained.home), "--model-dir", str(TINY), "--replica", nowhere]
    args += ["--expect", str(trained.reference), "--port", str(free_port())]
    probe = EventProcess(args, serving_token, tmp_path / "probe.log")
    probe.wait_for_event("checking", 120)
    began = time.monotonic()
    assert probe.terminate(timeout=30) == -signal.SIGTERM  # not killed after the grace period
    assert time.monotonic() - began < 10


def test_repeated_request_id_returns_the_stored_answer(probe_url: str, serving_home: Path, serving_token: str) -> None:
    task = _dev(serving_home)[5].id
    request_id = uuid.uuid4().hex
    first = _infer(probe_url, serving_token, request_id, task)
    again = _infer(probe_url, serving_token, request_id, task)
    assert first.status_code == again.status_code == 200
    assert first.json()["cached"] is False
    assert again.json()["cached"] is True
    assert again.json() == {**first.json(), "cached": True}


def test_reused_request_id_with_another_task_is_refused(probe_url: str, serving_home: Path, serving_token: str) -> None:
    items = _dev(serving_home)
    request_id = uuid.uuid4().hex
    assert _infer(probe_url, serving_token, request_id, items[6].id).status_code == 200
    reply = _infer(probe_url, serving_token, request_id, items[7].id)
    assert reply.status_code == 400
    assert "was used for task" in reply.json()["detail"]


def test_unknown_task_is_refused(probe_url: str, serving_token: str) -> None:
    reply = _infer(probe_url, serving_token, uuid.uuid4().hex, "0" * 64)
    assert reply.status_code == 404
    assert "not a prepared dev task" in reply.json()["detail"]


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        b'{"request_id": "r1"}',
        b'{"request_id": "r1", "task_id": "t", "prompt": "x"}',
        b'{"request_id": 7, "task_id": "t"}',
        b'{"request_id": "has space", "task_id": "t"}',
    ],
)
def test_malformed_bodies_are_refused(probe_url: str, serving_token: str, body: bytes) -> None:
    reply = httpx.post(f"{probe_url}/infer", content=body, headers=_auth(serving_token), timeout=30)
    assert reply.status_code == 400, reply.text


def test_oversized_body_is_refused(probe_url: str, serving_token: str) -> None:
    body = b'{"request_id": "r1", "task_id": "' + b"a" * 1100 + b'"}'
    reply = httpx.post(f"{probe_url}/infer", content=body, headers=_auth(serving_token), timeout=30)
    assert reply.status_code == 413
    assert "1024 bytes" in reply.json()["detail"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": "x"}])
def test_missing_or_wrong_token_is_refused(probe_url: str, serving_home: Path, headers: dict[str, str]) -> None:
    body = {"request_id": uuid.uuid4().hex, "task_id": _dev(serving_home)[0].id}
    assert httpx.post(f"{probe_url}/infer", json=body, headers=headers, timeout=30).status_code == 401
    assert httpx.get(f"{probe_url}/health", headers=headers, timeout=30).status_code == 401
