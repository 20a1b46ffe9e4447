"""A real vLLM (CPU) replica stopped while it answers a request: the request is answered in full, a request sent
while it drains is refused by the probe (never served cut short) and the probe reports the replica stopping, and
vLLM exits by itself within the grace period instead of waiting to be killed."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from experiment.learning.corpus import TaskItem
from experiment.seed import seedtokenizer
from experiment.serving.probe import InferRequest, ProbeService, ReplicaError
from tests.integration.serving.conftest import STARTUP_SECONDS
from tests.integration.serving.support import TINY, EventProcess, needs_vllm
from tests.support.processes import free_port

pytestmark = [pytest.mark.slow, needs_vllm]

LONG = 600  # tokens: seconds of work on the CPU, so that the stop lands in the middle of it


def _probe_while_draining(url: str, warm: threading.Event, outcome: dict[str, str]) -> None:
    """A probe's requests to the replica, a new one every 50 ms (at most 8 in flight), from before it is told to
    stop until one is refused: vLLM aborts the requests that reach it while it drains, and its own /health still
    answers 200 then. Requests sent at a steady pace, not one after another, so that some land in the drain however
    slowly each is answered on a loaded machine; one that reaches the engine after the drain waits until the server
    closes, long after the aborted ones are answered."""
    tokenizer = seedtokenizer.read_tokenizer(TINY)
    prompt_ids = tokenizer.encode("The table")
    item = TaskItem("dev-drain", "dev", 0, "lookup", 0, False, "The table", {}, prompt_ids)

    async def probe() -> None:
        async with httpx.AsyncClient() as client:
            service = ProbeService([item], tokenizer, url, 4, 1, client)
            refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            answered = 0

            async def one() -> None:
                nonlocal answered
                try:
                    await service._generate(InferRequest(request_id="drain", task_id=item.id), item)
                except ReplicaError as exc:
                    if not refused.done():
                        refused.set_result(exc.detail)
                    return
                answered += 1
                warm.set()

            in_flight: set[asyncio.Task[None]] = set()
            deadline = time.monotonic() + 120
            while not refused.done() and time.monotonic() < deadline:
                if len(in_flight) < 8:
                    task = asyncio.create_task(one())
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                await asyncio.wait([refused], timeout=0.05)
            outcome["refused"] = await asyncio.wait_for(refused, 1)
            outcome["answered_before"] = str(answered)
            outcome["replica_health"] = str((await client.get(f"{url}/health")).status_code)
            try:
                await service.health()
            except ReplicaError as health:
                outcome["probe_health"] = health.detail
            for task in list(in_flight):
                task.cancel()

    asyncio.run(probe())


def test_a_replica_stopped_mid_request_answers_it_and_exits_by_itself(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["replica", "--model-dir", str(TINY), "--served-model-name", "tiny-seed", "--port", str(port)]
    served = EventProcess(args, "unused", tmp_path / "replica.log")
    codes: list[int] = []

    def stop() -> None:
        codes.append(served.terminate(timeout=120))

    stopping = threading.Thread(target=stop)
    outcome: dict[str, str] = {}
    warm = threading.Event()
    probing = threading.Thread(target=_probe_while_draining, args=(url, warm, outcome))
    body = {
        "model": "tiny-seed",
        "prompt": "The table",
        "max_tokens": LONG,
        "min_tokens": LONG,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        served.wait_for_event("healthy", STARTUP_SECONDS)
        probing.start()
        assert warm.wait(60), "the probe's first request was not answered"
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300.0) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            first = next(lines)  # the first tokens: the request is running
            stopping.start()  # as the agent stops a replica: SIGTERM to `coop replica`
            chunks = [first, *lines]
        stopping.join(timeout=120)
        probing.join(timeout=120)
    finally:
        served.terminate()
    # Answered in full while the replica ran; refused as unfinished once vLLM drained and still called itself
    # healthy; the probe said it was stopping.
    assert int(outcome["answered_before"]) > 0, outcome
    assert outcome["refused"].endswith("did not finish task dev-drain: abort"), outcome
    assert outcome["replica_health"] == "200", outcome
    assert outcome["probe_health"].endswith("is stopping: it aborted task dev-drain"), outcome
    assert chunks[-1] == "data: [DONE]"
    events = [json.loads(chunk.removeprefix("data: ")) for chunk in chunks[:-1]]
    # Answered in full, though the stop came in the middle: not cut short ("abort"), every token there.
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == LONG
    stopped = served.wait_for_event("stopped", 5)
    # vLLM ended by itself after draining; a server killed after the grace period would say -9.
    assert (stopped["reason"], stopped["returncode"], codes) == ("SIGTERM", 0, [0]), stopped
