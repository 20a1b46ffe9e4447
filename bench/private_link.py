"""The pair's update over a private link shaped like a real one (root: network namespaces).

Two ranks of the real ``Trainer``, each in the namespace of its host (scripts/namespaces.py), their gloo
collectives pinned to the private interface, which ``tbf`` shapes on both ends. For each link rate and DDP bucket
size it measures, per rank:

- ``compute``: the rank's median update with every backward inside ``no_sync`` (no collective at all);
- ``pair``: the median update as a rank of the pair trains (the last backward all-reduces the gradients);
- the bytes the rank sent on the private interface per update, against the ring all-reduce's theory,
  ``2 (N-1)/N x 4 B x parameters``;

and compares the pair's update with ``compute + comm`` (no overlap) and ``max(compute, comm)`` (full overlap),
where ``comm`` is the theory's bytes at the link's rate. One bucket (the engine's ``BUCKET_CAP_MB``) starts the
all-reduce after the last backward; smaller buckets start it earlier, and the gap between them is the overlap
the buckets give.

    python bench/private_link.py [--rates none,1gbit,200mbit] [--buckets 1024,4,1] [--updates 12]
    > bench/results/private-link-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hostset import hosts, rate_bits  # noqa: E402  (ROOT on the path first)

PORT = 29555


# A rank (run inside its host's namespace) -----------------------------------------------------------------


def rank_main(home: Path, model_dir: Path, updates: int, bucket_cap_mb: int, interface: str) -> None:
    import psutil
    import torch

    from experiment.core import determinism
    from experiment.learning import distributed, training
    from experiment.learning.corpus import load_prepared
    from experiment.learning.updates import Trainer, wrap_ddp
    from experiment.seed import seedmodel

    prepared = load_prepared(home)
    plan = prepared.plan
    world = distributed.world_from_env()
    determinism.make_deterministic("cpu", plan.runtime.cpu_threads)
    device = torch.device("cpu")
    distributed.start(world, "gloo", timeout_seconds=120)
    model = seedmodel.load_model(model_dir)
    documents = training.documents_for(prepared, "clean-pair")
    batches = training.schedule(plan)
    result: dict[str, Any] = {"rank": world.rank, "bucket_cap_mb": bucket_cap_mb}
    with Trainer(plan, world, device, model, documents) as trainer:
        trainer.network = wrap_ddp(model, device, bucket_cap_mb)
        for phase in ("compute", "pair"):
            seconds = []
            sent_before = psutil.net_io_counters(pernic=True)[interface].bytes_sent
            for step, batch in enumerate(batches[: updates + 1], start=1):
                began = time.monotonic()
                if phase == "compute":
                    with trainer.network.no_sync():  # type: ignore[operator]
                        _local_backward(trainer, batch)
                else:
                    trainer.accumulate(batch)
                trainer.step(step)
                seconds.append(time.monotonic() - began)
            sent = psutil.net_io_counters(pernic=True)[interface].bytes_sent - sent_before
            result[phase] = {
                "median_seconds": statistics.median(seconds[1:]),  # the first update warms up
                "bytes_sent_per_update": sent / len(seconds),
            }
        result["parameters"] = sum(p.numel() for p in model.parameters())
    distributed.stop(world)
    print(json.dumps(result), flush=True)


def _local_backward(trainer: Any, batch: list[int]) -> None:
    """Every local document's forward and backward, as ``accumulate`` does them, with no collective at all."""
    from experiment.learning import updates

    docs = trainer.documents
    weighted = sum(docs[p].targets * docs[p].weight for p in batch)
    for position in updates.local_positions(batch, trainer.world):
        document = docs[position]
        loss = updates.document_loss_sum(trainer.network, document, trainer.device, "none")
        (loss * trainer.scale(trainer.world.size, document.weight, weighted)).backward()


# The bench ------------------------------------------------------------------------------------------------


def _pair(topology: dict[str, Any], home: Path, model_dir: Path, updates: int, bucket: int) -> list[dict[str, Any]]:
    rank0 = topology["hosts"][0]
    processes = []
    for rank, host in enumerate(topology["hosts"]):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": rank0["private_address"],
            "MASTER_PORT": str(PORT),
            "GLOO_SOCKET_IFNAME": host["private_interface"],
            "OMP_NUM_THREADS": "1",
        }
        argv = [*("ip", "netns", "exec", host["namespace"]), sys.executable, __file__, "--rank"]
        argv += [str(home), str(model_dir), str(updates), str(bucket), host["private_interface"]]
        processes.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=600) for p in processes]
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        if process.returncode:
            raise SystemExit(f"a rank failed ({process.returncode}):\n{stderr[-3000:]}")
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]


def _row(rate: str | None, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    parameters = ranks[0]["parameters"]
    theory = 2 * (2 - 1) / 2 * 4 * parameters
    compute = max(r["compute"]["median_seconds"] for r in ranks)
    pair = max(r["pair"]["median_seconds"] for r in ranks)
    sent = [r["pair"]["bytes_sent_per_update"] for r in ranks]
    row: dict[str, Any] = {
        "rate": rate or "unshaped",
        "bucket_cap_mb": ranks[0]["bucket_cap_mb"],
        "compute_seconds": round(compute, 4),
        "pair_seconds": round(pair, 4),
        "bytes_per_update_per_rank": [round(s) for s in sent],
        "theory_bytes_per_update": theory,
        "bytes_over_theory": [round(s / theory, 4) for s in sent],
    }
    if rate is not None:
        comm = theory * 8 / rate_bits(rate)
        row |= {
            "comm_seconds_at_rate": round(comm, 4),
            "pair_over_compute_plus_comm": round(pair / (compute + comm), 4),
            "pair_over_max_compute_comm": round(pair / max(compute, comm), 4),
        }
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, default=ROOT / "plans" / "local.toml")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "seeds" / "tiny")
    parser.add_argument("--rates", default="none,1gbit,200mbit")
    parser.add_argument("--buckets", default="1024,4,1", help="DDP bucket_cap_mb values")
    parser.add_argument("--updates", type=int, default=12)
    args = parser.parse_args()
    rates = [None if r == "none" else r for r in args.rates.split(",")]
    buckets = [int(b) for b in args.buckets.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="coop-private-link-") as scratch:
        home = Path(scratch) / "home"
        coop = [sys.executable, "-m", "experiment.cli", "prepare", "--plan", str(args.plan), "--home", str(home)]
        subprocess.run([*coop, "--model-dir", str(args.model_dir)], check=True, capture_output=True, cwd=ROOT)
        for rate in rates:
            with hosts(2, rate) as topology:
                for bucket in buckets:
                    row = _row(rate, _pair(topology, home, args.model_dir.resolve(), args.updates, bucket))
                    print(json.dumps({"event": "measured", **row}), file=sys.stderr, flush=True)
                    rows.append(row)
    print(
        json.dumps({"bench": "private-link", "plan": args.plan.name, "updates": args.updates, "rows": rows}, indent=2)
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        sys.exit(main())
