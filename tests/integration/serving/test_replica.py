"""A real vLLM (CPU) replica stopped while it answers a request: the request is answered in full, and vLLM
exits by itself within the grace period instead of waiting to be killed."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.integration.serving.conftest import STARTUP_SECONDS
from tests.integration.serving.support import TINY, EventProcess, needs_vllm
from tests.support.processes import free_port

pytestmark = [pytest.mark.slow, needs_vllm]

LONG = 600  # tokens: seconds of work on the CPU, so that the stop lands in the middle of it


def test_a_replica_stopped_mid_request_answers_it_and_exits_by_itself(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["replica", "--model-dir", str(TINY), "--served-model-name", "tiny-seed", "--port", str(port)]
    served = EventProcess(args, "unused", tmp_path / "replica.log")
    codes: list[int] = []
    stopping = threading.Thread(target=lambda: codes.append(served.terminate(timeout=120)))
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
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300.0) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            first = next(lines)  # the first tokens: the request is running
            stopping.start()  # as the agent stops a replica: SIGTERM to `coop replica`
            chunks = [first, *lines]
        stopping.join(timeout=120)
    finally:
        served.terminate()
    assert chunks[-1] == "data: [DONE]"
    events = [json.loads(chunk.removeprefix("data: ")) for chunk in chunks[:-1]]
    # Answered in full, though the stop came in the middle: not cut short ("abort"), every token there.
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == LONG
    stopped = served.wait_for_event("stopped", 5)
    # vLLM ended by itself after draining; a server killed after the grace period would say -9.
    assert (stopped["reason"], stopped["returncode"], codes) == ("SIGTERM", 0, [0]), stopped
