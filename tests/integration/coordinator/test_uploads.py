"""Uploads are idempotent under their key; bodies are validated (400 with the reason) and bounded (413)."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable, Iterator
from typing import Any

from litestar.testing import AsyncTestClient

from experiment import wire
from experiment.core.plan import load_plan
from server.app import create_app
from server.settings import Settings
from tests.integration.coordinator.support import Api, running
from tests.support.agent import FakeAgent, rejection
from tests.support.scenarios import LOCAL_PLAN, bearer


def _claimed(api: Api) -> tuple[FakeAgent, wire.Assignment]:
    a = api.agent("a")
    api.create_experiment()
    job = a.claim()
    assert job is not None
    return a, job


def _events(
    api: Api, agent: FakeAgent, job: wire.Assignment, sequence: int, kinds: list[str], key: str | None = None
) -> Any:
    """An event batch sent raw, under ``key`` (by default the one that names it), whatever the answer."""
    headers = bearer(agent.token)
    headers["Idempotency-Key"] = key if key is not None else f"{job.job_id}:{job.attempt_id}:{sequence}"
    body = {"lease_token": job.lease_token, "sequence": sequence, "events": [{"kind": k, "body": {}} for k in kinds]}
    return api.client.post(f"/api/attempts/{job.attempt_id}/events", json=body, headers=headers)


def test_event_batch_replay_returns_the_stored_reply_and_stores_once(api: Api) -> None:
    a, job = _claimed(api)
    first = _events(api, a, job, 0, ["step", "step"])
    assert first.status_code == 201 and first.json()["accepted"] == 2
    replay = _events(api, a, job, 0, ["step", "step"])
    assert (replay.status_code, replay.content) == (first.status_code, first.content)
    stored = api.get(f"/api/attempts/{job.attempt_id}/events")["items"]
    assert [e["kind"] for e in stored if e["sequence"] == 0] == ["step", "step"]


def test_replay_with_a_different_payload_is_a_conflict(api: Api) -> None:
    a, job = _claimed(api)
    assert _events(api, a, job, 3, ["step"]).status_code == 201
    conflict = _events(api, a, job, 3, ["resources"])
    assert conflict.status_code == 409 and conflict.json()["rule"] == "idempotency-key-reused"


def test_upload_needs_the_key_that_names_it(api: Api) -> None:
    a, job = _claimed(api)
    missing = api.client.post(
        f"/api/attempts/{job.attempt_id}/events",
        json={"lease_token": job.lease_token, "sequence": 0, "events": [{"kind": "step"}]},
        headers=bearer(a.token),
    )
    assert missing.status_code == 400 and "Idempotency-Key" in missing.json()["detail"]
    wrong = _events(api, a, job, 1, ["step"], key=f"{job.job_id}:{job.attempt_id}:2")
    assert wrong.status_code == 400 and "does not name this upload" in wrong.json()["detail"]


def test_result_replay_after_the_attempt_ended_returns_the_stored_reply(api: Api) -> None:
    a, job = _claimed(api)
    first = a.finish(job, result={"prepared_identity": "ab" * 32})
    assert first.state == "succeeded"
    assert a.finish(job, result={"prepared_identity": "ab" * 32}) == first
    different = rejection(a.finish, job, result={"prepared_identity": "cd" * 32})
    assert different.status_code == 409 and different.rule == "idempotency-key-reused"


def test_malformed_result_is_refused_and_leaves_the_attempt_running(api: Api) -> None:
    a, job = _claimed(api)
    refused = rejection(a.finish, job, result={"prepared_identity": "not a digest"})
    assert refused.status_code == 400 and "prepared_identity" in refused.detail
    assert api.get(f"/api/attempts/{job.attempt_id}")["state"] == "leased"


def test_bad_bodies_are_400_with_the_reason(api: Api) -> None:
    post = api.client.post
    headers = bearer(api.operator)
    unknown = post("/api/experiments", json={"plan_toml": "x", "colour": "red"}, headers=headers)
    assert unknown.status_code == 400 and "colour" in unknown.text
    wrong_type = post("/api/experiments", json={"plan_toml": 7}, headers=headers)
    assert wrong_type.status_code == 400 and "plan_toml" in wrong_type.text
    not_json = post("/api/experiments", content=b"{not json", headers={**headers, "Content-Type": "application/json"})
    assert not_json.status_code == 400
    bad_plan = post("/api/experiments", json={"plan_toml": 'name = "x"\n'}, headers=headers)
    assert bad_plan.status_code == 400 and "invalid plan" in bad_plan.json()["detail"]
    bad_role = api.operator_post(
        f"/api/experiments/{api.create_experiment()['id']}/jobs", {"kind": "evaluate", "arm": "seed", "role": "exam"}
    )
    assert bad_role.status_code == 400 and "role" in bad_role.text


def test_oversized_body_is_413(make_settings: Callable[..., Settings], database_url: str) -> None:
    with running(make_settings(max_body_bytes=64 * 1024)) as client:
        api = Api(client, database_url)
        a, job = _claimed(api)
        huge = _events(api, a, job, 0, ["step"] * 8000)
        assert huge.status_code == 413
        assert _events(api, a, job, 0, ["step"] * 10).status_code == 201


def _race(settings: Settings, posts: list[tuple[str, dict[str, Any], dict[str, str]]]) -> list[Any]:
    """Send every post at once to one app (on one event loop, so they interleave inside the server)."""

    async def go() -> list[Any]:
        async with AsyncTestClient(create_app(settings)) as client:
            return list(await asyncio.gather(*(client.post(path, json=body, headers=h) for path, body, h in posts)))

    return asyncio.run(go())


def test_simultaneous_first_uploads_of_one_key_store_once_and_answer_alike(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    settings = make_settings()
    with running(settings) as client:
        api = Api(client, database_url)
        a, job = _claimed(api)
    events_path = f"/api/attempts/{job.attempt_id}/events"
    key = {**bearer(a.token), "Idempotency-Key": f"{job.job_id}:{job.attempt_id}:0"}
    batch = {"lease_token": job.lease_token, "sequence": 0, "events": [{"kind": "step", "body": {"step": 1}}]}
    replies = _race(settings, [(events_path, batch, key)] * 8)
    assert {(r.status_code, r.content) for r in replies} == {(201, replies[0].content)}
    # Two payloads race for the result key: one wins, every copy of it gets the stored reply, the other is 409.
    result_path = f"/api/attempts/{job.attempt_id}/result"
    result_key = {**bearer(a.token), "Idempotency-Key": f"{job.job_id}:{job.attempt_id}:result"}
    bodies = [
        {"lease_token": job.lease_token, "outcome": "succeeded", "result": {"prepared_identity": digit * 64}}
        for digit in "ab"
    ]
    replies = _race(settings, [(result_path, bodies[i % 2], result_key) for i in range(8)])
    by_payload = [{(r.status_code, r.content) for r in replies[i::2]} for i in range(2)]
    statuses = sorted(next(iter(group))[0] for group in by_payload)
    assert all(len(group) == 1 for group in by_payload) and statuses == [200, 409], by_payload
    with running(settings) as client:
        stored = client.get(f"/api/attempts/{job.attempt_id}/events").json()["items"]
        assert [e["kind"] for e in stored if e["sequence"] == 0] == ["step"]
        assert client.get(f"/api/attempts/{job.attempt_id}").json()["state"] == "succeeded"


def _blob(api: Api, agent: FakeAgent, job: wire.Assignment, data: bytes, sized: bool = True) -> Any:
    """A blob upload as a stranger holding the agent's token might send it: streamed, its length declared or not."""
    digest = hashlib.sha256(data).hexdigest()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(data), 1 << 20):
            yield data[start : start + (1 << 20)]

    headers = bearer(agent.token) | {"Content-Type": "application/octet-stream"}
    if sized:
        headers["Content-Length"] = str(len(data))
    return api.client.put(f"/api/blobs/{digest}?attempt={job.attempt_id}", content=chunks(), headers=headers)


def test_an_attempts_evidence_past_its_plans_quota_is_refused_naming_the_quota(api: Api) -> None:
    a, job = _claimed(api)
    a.start(job)
    quota = load_plan(LOCAL_PLAN).evidence_quota()
    first = random.Random(1).randbytes(quota // 2)
    assert _blob(api, a, job, first).status_code == 201
    assert _blob(api, a, job, first).status_code == 200  # the same content again costs nothing more
    # Declared past what the quota leaves: refused before the body is read.
    declared = _blob(api, a, job, random.Random(2).randbytes(quota // 2 + 1024))
    assert declared.status_code == 413, declared.text
    assert (
        f"what attempt {job.attempt_id}'s evidence quota leaves: {quota - len(first)} of its plan's {quota}"
        in (declared.json()["detail"])
    )
    # Streamed with no length: refused once the bytes pass it, and nothing of it is kept.
    streamed = _blob(api, a, job, random.Random(3).randbytes(quota // 2 + 1024), sized=False)
    assert streamed.status_code == 413 and "evidence quota" in streamed.json()["detail"]
    missing = api.client.get(f"/api/blobs/{hashlib.sha256(random.Random(3).randbytes(quota // 2 + 1024)).hexdigest()}")
    assert missing.status_code == 404
    # What the quota leaves still fits.
    assert _blob(api, a, job, b"a small journal").status_code == 201
