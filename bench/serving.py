"""Serving throughput on this CPU: our probe in front of a vLLM replica, the same replica called directly, and a
reference-style replica (bench/reference_replica.py: HF generate, one request at a time behind a lock), on the
local plan's workload (the first 32 dev tasks) with every answer forced to the same length (EOS ignored,
--tokens new tokens), at client concurrency 2 and 8, in interleaved rounds (best of each kept). vLLM's CPU
engine and the reference each compute on one core. Through the probe, each request's time outside the replica
(end to end minus the replica's time, as the probe measured it) is what the probe's hop adds. Prints one JSON
object.

Usage: python bench/serving.py [--model-dir seeds/tiny] [--tokens 96] [--output bench/results/serving-cpu.json]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from experiment.core.plan import load_plan
from experiment.learning import corpus
from experiment.serving import probe, replica

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "plans" / "local.toml"
# (client, index, task id) -> (output tokens, seconds the replica took as the probe measured it, or None)
Send = Callable[[httpx.AsyncClient, int, str], Awaitable[tuple[int, float | None]]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _load(send: Send, task_ids: list[str], concurrency: int) -> dict[str, Any]:
    latencies: list[float] = []
    tokens: list[int] = []
    in_probe: list[float] = []  # per request, end-to-end minus the replica's time: what the probe's hop adds
    pending = list(enumerate(task_ids))

    async def worker(client: httpx.AsyncClient) -> None:
        while pending:
            index, task_id = pending.pop(0)
            began = time.perf_counter()
            count, replica_seconds = await send(client, index, task_id)
            latency = (time.perf_counter() - began) * 1000
            tokens.append(count)
            latencies.append(latency)
            if replica_seconds is not None:
                in_probe.append(latency - replica_seconds * 1000)

    async with httpx.AsyncClient(timeout=600) as client:
        began = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        duration = time.perf_counter() - began
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "duration": round(duration, 3),
        "request_throughput": round(len(latencies) / duration, 3),
        "output_throughput": round(sum(tokens) / duration, 1),
        "output_tokens": sorted(set(tokens)),
        "mean_e2el_ms": round(statistics.fmean(latencies), 1),
        "median_e2el_ms": round(statistics.median(latencies), 1),
        "mean_outside_replica_ms": round(statistics.fmean(in_probe), 1) if in_probe else None,
    }


def _wait(url: str, process: subprocess.Popen[bytes], headers: dict[str, str], timeout: float) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if process.poll() is not None:
            raise SystemExit(f"{process.args!r} exited with code {process.returncode}")
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=2).status_code == 200:
                return time.monotonic() - began
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} was not healthy within {timeout:.0f} s")


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _serve_probe(argv: list[str]) -> None:
    """Child mode: the probe with EOS ignored (equal output lengths), as `coop probe` runs it otherwise."""
    home, model_dir, replica_url, port = argv
    token = os.environ["COOP_SERVING_TOKEN"]
    # No identity check: every answer here is forced past EOS, so none is the evaluation's.
    probe.run(Path(home), Path(model_dir), replica_url, "127.0.0.1", int(port), token, lambda event: None, None, True)


def main() -> None:
    if sys.argv[1:2] == ["--serve-probe"]:
        _serve_probe(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", type=Path, default=ROOT / "seeds" / "tiny")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    plan = load_plan(PLAN)
    work = Path(tempfile.mkdtemp(prefix="coop-bench-serving-"))
    home = work / "home"
    corpus.prepare(plan, PLAN, home, args.model_dir, None, lambda event: None)
    items = {item.id: item for item in corpus.load_prepared(home).task_items("dev")[: plan.serving.workload_tasks]}
    task_ids = list(items)
    token = secrets.token_urlsafe(24)
    headers = {"Authorization": f"Bearer {token}"}
    os.environ["COOP_SERVING_TOKEN"] = token

    spec = replica.ReplicaSpec(
        model_dir=args.model_dir, served_model_name="tiny-seed", port=_free_port(), python=replica.vllm_python()
    )
    vllm = replica.Replica(spec, (work / "vllm.log").open("wb"))
    vllm.start()
    processes: list[subprocess.Popen[bytes]] = []
    try:
        healthy_seconds = vllm.wait_healthy(900)
        probe_port, reference_port = _free_port(), _free_port()
        probe_url, reference_url = f"http://127.0.0.1:{probe_port}", f"http://127.0.0.1:{reference_port}"
        serve_probe = [sys.executable, __file__, "--serve-probe", str(home), str(args.model_dir), spec.url]
        processes.append(_spawn([*serve_probe, str(probe_port)]))
        reference = [sys.executable, str(ROOT / "bench" / "reference_replica.py"), "--home", str(home)]
        reference += ["--model-dir", str(args.model_dir), "--tokens", str(args.tokens), "--port", str(reference_port)]
        processes.append(_spawn(reference))
        _wait(probe_url, processes[0], headers, 300)
        _wait(reference_url, processes[1], {}, 300)
        run_id = secrets.token_hex(4)

        async def direct(client: httpx.AsyncClient, index: int, task_id: str) -> tuple[int, float | None]:
            body = {"model": spec.served_model_name, "prompt": items[task_id].prompt_ids, "max_tokens": args.tokens}
            body |= {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
            reply = await client.post(f"{spec.url}/v1/completions", json=body)
            reply.raise_for_status()
            return len(reply.json()["choices"][0]["token_ids"]), None

        def through(url: str) -> Send:
            async def send(client: httpx.AsyncClient, index: int, task_id: str) -> tuple[int, float | None]:
                body = {"request_id": f"{run_id}-{time.monotonic_ns()}-{index}", "task_id": task_id}
                reply = await client.post(f"{url}/infer", json=body, headers=headers)
                reply.raise_for_status()
                answer = reply.json()
                return len(answer["output_ids"]), answer.get("replica_seconds")

            return send

        runs: list[dict[str, Any]] = []
        sends = {"vllm_direct": direct, "probe_vllm": through(probe_url), "reference_hf": through(reference_url)}
        for send in sends.values():
            asyncio.run(_load(send, task_ids[:2], 2))  # warm-up, not measured
        # Interleaved rounds, best of each: this host is shared, and its load changes within minutes.
        for round_number in range(args.rounds):
            for concurrency in args.concurrency:
                for name, send in sends.items():
                    run = asyncio.run(_load(send, task_ids, concurrency))
                    runs.append({"round": round_number, "server": name, **run, "load_average": os.getloadavg()[0]})
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=60)
        vllm.stop()
        shutil.rmtree(work, ignore_errors=True)

    def best(name: str, concurrency: int) -> dict[str, Any]:
        mine = [r for r in runs if r["server"] == name and r["concurrency"] == concurrency]
        return max(mine, key=lambda r: float(r["request_throughput"]))

    summary = {
        str(c): {
            name: {
                key: best(name, c)[key]
                for key in ("request_throughput", "output_throughput", "mean_e2el_ms", "mean_outside_replica_ms")
            }
            for name in sends
        }
        for c in args.concurrency
    }
    comparison = {
        str(c): {
            "probe_vllm_over_reference_hf": round(
                best("probe_vllm", c)["request_throughput"] / best("reference_hf", c)["request_throughput"], 2
            ),
            "probe_vllm_over_vllm_direct": round(
                best("probe_vllm", c)["request_throughput"] / best("vllm_direct", c)["request_throughput"], 3
            ),
            "probe_added_mean_ms": round(
                best("probe_vllm", c)["mean_e2el_ms"] - best("vllm_direct", c)["mean_e2el_ms"], 1
            ),
        }
        for c in args.concurrency
    }
    result = {
        "bench": "serving",
        "device": "cpu",
        "cpus": os.cpu_count(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "model": str(args.model_dir.relative_to(ROOT) if args.model_dir.is_relative_to(ROOT) else args.model_dir),
        "requests": len(task_ids),
        "forced_output_tokens": args.tokens,
        "vllm": {"healthy_seconds": round(healthy_seconds, 1), "args": replica.command(spec)[1:]},
        "rounds": args.rounds,
        "best": summary,
        "comparison": comparison,
        "runs": runs,
    }
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
