"""Median update seconds, single process vs the two-rank pair on this CPU (same global batch), and the
gradient bytes per update against the theoretical ring all-reduce volume ``2 (N-1)/N x 4 B x parameters``.

Runs the real ``coop prepare`` and ``coop train`` (the pair through ``torchrun``) in a temporary home and
prints one JSON object. Usage: python bench/train_step.py [--plan plans/local.toml] [--model-dir seeds/tiny]
[--updates 12]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from experiment.seed import seedmodel

ROOT = Path(__file__).resolve().parents[1]


def _loopback_bytes() -> int:
    counters = psutil.net_io_counters(pernic=True)
    return sum(c.bytes_sent for name, c in counters.items() if name.startswith("lo"))


def _run(args: list[str]) -> list[dict[str, object]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _median_step_seconds(events: list[dict[str, object]], rank: int) -> float:
    seconds = [float(str(e["seconds"])) for e in events if e.get("event") == "step" and e.get("rank") == rank]
    return statistics.median(seconds[1:] if len(seconds) > 2 else seconds)  # the first update warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", type=Path, default=ROOT / "plans" / "local.toml")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "seeds" / "tiny")
    parser.add_argument("--updates", type=int, default=12)
    args = parser.parse_args()
    coop = [sys.executable, "-m", "experiment.cli"]
    with tempfile.TemporaryDirectory() as scratch:
        home = Path(scratch) / "home"
        _run([*coop, "prepare", "--plan", str(args.plan), "--home", str(home), "--model-dir", str(args.model_dir)])
        train = ["train", "--home", str(home), "--model-dir", str(args.model_dir), "--stop-after", str(args.updates)]
        single = _run([*coop, *train, "--arm", "clean-single"])
        before = _loopback_bytes()
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "experiment.cli"]
        pair = _run([*torchrun, *train, "--arm", "clean-pair"])
        sent = _loopback_bytes() - before
    parameters = seedmodel.count_parameters(args.model_dir)
    world = 2
    single_median = _median_step_seconds(single, 0)
    pair_median = _median_step_seconds(pair, 0)
    theoretical = 2 * (world - 1) / world * 4 * parameters
    print(
        json.dumps(
            {
                "bench": "train_step",
                "device": "cpu",
                "threads_per_rank": 1,
                "updates": args.updates,
                "documents_per_update": 8,
                "parameters": parameters,
                "median_update_seconds_single": round(single_median, 4),
                "median_update_seconds_pair": round(pair_median, 4),
                "pair_over_single": round(pair_median / single_median, 3),
                "gradient_bytes_theoretical_per_rank_per_update": int(theoretical),
                "loopback_bytes_sent_per_rank_per_update": int(sent / world / args.updates),
                "loopback_note": "both ranks on one host: all loopback traffic during the pair run "
                "(process-group setup and digest agreement included), divided by ranks and updates",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
