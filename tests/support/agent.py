"""One fake agent for every suite: the real client (agent.client.Coordinator) driven step by step by a test, so
that each registration, claim, start, heartbeat, event batch, result and evidence upload is the agent's own
request (its wire types, lease proofs and Idempotency-Keys). Tests of the server's refusals of malformed requests
send those raw instead."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest

from agent.client import Coordinator, Rejected, upload_key
from agent.supervisor import to_event
from experiment import wire


def answer(index: int, correct: bool, family: str = "lookup", variant: int = 0) -> dict[str, Any]:
    """One answer as experiment.learning.evaluation.Answer writes it."""
    return {
        "id": f"{index:032x}",
        "index": index,
        "family": family,
        "variant": variant,
        "input_dependent": index % 2 == 0,
        "prompt_ids": [1, 2, 3],
        "output_ids": [4, 5, 2],
        "text": '{"a": 1}',
        "seconds": 0.01,
        "ended_with_eos": True,
        "hit_token_limit": False,
        "check": {
            "correct": correct,
            "valid_json_object": True,
            "reason": "correct" if correct else "wrong_schema_or_value",
        },
    }


def answers_file(answers: list[dict[str, Any]]) -> bytes:
    """answers.jsonl as experiment.learning.evaluation writes it: one answer per line."""
    return "".join(json.dumps(item) + "\n" for item in answers).encode()


def rejection(call: Callable[..., object], *args: Any, **kwargs: Any) -> Rejected:
    """The coordinator's refusal of ``call(*args, **kwargs)`` (a 4xx with its detail and rule); fails the test if
    the call was accepted."""
    with pytest.raises(Rejected) as refused:
        call(*args, **kwargs)
    return refused.value


class FakeAgent:
    """An agent whose every step the test takes: nothing runs, the test says what the command did.

    ``transport`` reaches an in-process app (a Litestar TestClientTransport); without it, ``base_url`` is a real
    coordinator. The client never retries: a 5xx or a dropped connection fails the step at once."""

    def __init__(self, base_url: str, token: str, *, transport: httpx.BaseTransport | None = None) -> None:
        self.token = token
        self.client = Coordinator(base_url, token, retries=0, transport=transport)

    def close(self) -> None:
        self.client.close()

    def register(
        self, address: str, labels: dict[str, str] | None = None, private_address: str | None = None
    ) -> wire.Agent:
        return self.client.register(
            wire.AgentRegister(address=address, labels=labels or {}, private_address=private_address)
        )

    def claim(self, *kinds: wire.JobKind, wait: float = 0.0, key: str | None = None) -> wire.Assignment | None:
        """Lease one queued job of these kinds (any kind when none is named), if one is queued for this agent."""
        request = wire.ClaimRequest(wait_seconds=wait, kinds=list(kinds) or None, claim_key=key)
        return self.client.claim(request).assignment

    def start(self, job: wire.Assignment) -> wire.Attempt:
        return self.client.start(job.attempt_id, job.lease_token)

    def try_take(self, *kinds: wire.JobKind, wait: float = 0.0) -> wire.Assignment | None:
        """Claim and start one job of these kinds, as the agent does before it runs the job's command."""
        job = self.claim(*kinds, wait=wait)
        if job is not None:
            self.start(job)
        return job

    def take(self, *kinds: wire.JobKind, wait: float = 0.0) -> wire.Assignment:
        job = self.try_take(*kinds, wait=wait)
        assert job is not None, f"no {' or '.join(kinds) or 'job'} to claim"
        return job

    def heartbeat(self, *held: wire.Assignment, claiming: str | None = None) -> wire.HeartbeatReply:
        """A heartbeat naming the attempts ``held`` (and the key of a claim in flight)."""
        request = wire.HeartbeatRequest(attempt_ids=[job.attempt_id for job in held], claiming=claiming)
        return self.client.heartbeat(request)

    def events(self, job: wire.Assignment, sequence: int, *events: wire.Event) -> wire.EventBatchReply:
        batch = wire.EventBatch(lease_token=job.lease_token, sequence=sequence, events=list(events))
        key = upload_key(job.job_id, job.attempt_id, sequence)
        return self.client.upload_events(job.attempt_id, key, msgspec.json.encode(batch))

    def printed(self, job: wire.Assignment, sequence: int, *lines: str | dict[str, Any]) -> wire.EventBatchReply:
        """One batch of the lines the job's command printed (a dict is printed as its JSON line), each made an event
        as the agent makes it (agent.supervisor.to_event: a JSON object's kind is its ``event``, a line's
        ``output``)."""
        printed = (line if isinstance(line, str) else json.dumps(line) for line in lines)
        return self.events(job, sequence, *(to_event(line)[0] for line in printed))

    def finish(self, job: wire.Assignment, outcome: wire.Outcome = "succeeded", **fields: Any) -> wire.Attempt:
        """The attempt's result; ``fields`` are wire.AttemptResult's (result, journal, answers, evidence, ...)."""
        body = {"lease_token": job.lease_token, "outcome": outcome, "exit_code": 0 if outcome == "succeeded" else 1}
        result = msgspec.convert(body | fields, wire.AttemptResult)
        key = upload_key(job.job_id, job.attempt_id, "result")
        return self.client.upload_result(job.attempt_id, key, msgspec.json.encode(result))

    def upload(self, data: bytes, job: wire.Assignment) -> str:
        """A blob of evidence of the attempt ``job``; its sha256."""
        digest = hashlib.sha256(data).hexdigest()
        self.client.upload_blob(job.attempt_id, digest, data)
        return digest

    def evaluated(self, job: wire.Assignment, answers: list[dict[str, Any]] | None = None) -> wire.Attempt:
        """An evaluate job's result as the agent sends it: the answers, their answers.jsonl blob named as evidence,
        and that blob's sha256 as ``answers_sha256`` (one right answer unless ``answers`` are given)."""
        answers = [answer(0, True)] if answers is None else answers
        digest = self.upload(answers_file(answers), job)
        evidence = {f"evaluations/{job.role}/{job.arm}/answers.jsonl": digest}
        return self.finish(job, result={"answers_sha256": digest}, answers=answers, evidence=evidence)
