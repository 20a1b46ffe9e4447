"""The probe in front of a real vLLM replica: the evaluation's answers, the retry cache, and every refusal."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import msgspec
import pytest

from experiment import corpus, evaluation, seedmodel, tasks
from tests.integration.serving.support import TINY, needs_vllm

pytestmark = [pytest.mark.slow, needs_vllm]


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _infer(url: str, token: str, request_id: str, task_id: str) -> httpx.Response:
    body = {"request_id": request_id, "task_id": task_id}
    return httpx.post(f"{url}/infer", json=body, headers=_auth(token), timeout=120)


def _dev(home: Path) -> list[corpus.TaskItem]:
    return corpus.load_prepared(home).task_items("dev")


def test_greedy_answers_equal_the_evaluation(probe_url: str, serving_home: Path, serving_token: str) -> None:
    items = _dev(serving_home)[:4]
    tokenizer = seedmodel.load_tokenizer(TINY)
    model = seedmodel.load_model(TINY).eval()
    eos, pad = int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token)), int(tokenizer.pad_token_id)
    max_new_tokens = corpus.load_prepared(serving_home).plan.serving.max_new_tokens
    generations = evaluation.generate(model, [i.prompt_ids for i in items], eos, pad, max_new_tokens)
    for item, generation in zip(items, generations, strict=True):
        reply = _infer(probe_url, serving_token, uuid.uuid4().hex, item.id)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        text = evaluation.answer_text(tokenizer, generation)
        assert answer["output_ids"] == generation.output_ids
        assert answer["text"] == text
        assert answer["ended_with_eos"] == generation.ended_with_eos
        assert answer["hit_token_limit"] == generation.hit_token_limit
        assert answer["check"] == msgspec.to_builtins(tasks.check(text, item.expected))
        assert answer["model"] == "tiny-seed"
        assert answer["cached"] is False


def test_health_names_the_replica_model(probe_url: str, serving_token: str) -> None:
    reply = httpx.get(f"{probe_url}/health", headers=_auth(serving_token), timeout=10)
    assert reply.status_code == 200
    assert reply.json()["model"] == "tiny-seed"


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
