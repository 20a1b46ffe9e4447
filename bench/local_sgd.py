"""What DiLoCo saves: ddp-4 against diloco-4 (plans/local-diloco.toml) over a shared private link shaped like a
real one (root: network namespaces).

Four hosts (scripts/namespaces.py --hosts 4), every host's end of the private link shaped with ``tbf``. Each arm
is trained in full by the real ``coop train``, one rank in each host's namespace, its gloo collectives pinned to
the private interface. Per arm it reports, from the ranks' own result files:

- ``loop_seconds``: each rank's wall time for the plan's updates (128);
- ``written_bytes``: what each rank's process wrote during its updates (its journal's count), and the bytes its
  private interface sent (the kernel's count, headers included);
- ``theory_bytes``: synchronizations x 2 (N-1)/N x 4 B x parameters, per rank;
- ``link_bound_seconds``: the theory's bytes at the link's rate, the least time the synchronizations take, and
  ``loop_over_link_bound``.

With ``--report`` it also carries the figures of a recorded report of the same plan (`make run
PLAN=plans/local-diloco.toml`, on loopback): test accuracy per arm, the non-inferiority test, the verdict, the
bytes ratio and the wall time of each arm's loop.

    python bench/local_sgd.py [--rate 200mbit] [--report .coop/run-.../report.json] \
        > bench/results/local-sgd-200mbit-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hostset import hosts, rate_bits  # noqa: E402  (ROOT on the path first)

PORT = 29556


def _train(topology: dict[str, Any], home: Path, model_dir: Path, arm: str, ranks: int) -> list[dict[str, Any]]:
    """The arm trained by ``ranks`` real ``coop train`` processes, rank i on host i; their result files."""
    rank0 = topology["hosts"][0]
    processes = []
    for rank, host in enumerate(topology["hosts"][:ranks]):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": rank0["private_address"],
            "MASTER_PORT": str(PORT),
            "GLOO_SOCKET_IFNAME": host["private_interface"],
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
        }
        argv = [*("ip", "netns", "exec", host["namespace"]), sys.executable, "-m", "experiment.cli", "train"]
        argv += ["--home", str(home / host["name"]), "--model-dir", str(model_dir), "--arm", arm]
        processes.append(
            subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    for process in processes:
        _, stderr = process.communicate(timeout=1800)
        if process.returncode:
            raise SystemExit(f"a rank of {arm} failed ({process.returncode}):\n{stderr[-3000:]}")
    return [
        json.loads((home / host["name"] / "runs" / arm / f"rank-{rank}" / "result.json").read_text())
        for rank, host in enumerate(topology["hosts"][:ranks])
    ]


def _row(arm: str, results: list[dict[str, Any]], synchronizations: int, parameters: int, rate: str) -> dict[str, Any]:
    ranks = len(results)
    theory = synchronizations * 2 * (ranks - 1) / ranks * 4 * parameters
    written = [sum(record["written_bytes"] for record in r["journal"]) for r in results]
    interface = [
        r["network_end"]["interfaces"]["priv0"]["bytes_sent"] - r["network_start"]["interfaces"]["priv0"]["bytes_sent"]
        for r in results
    ]
    loop = [round(r["loop_seconds"], 2) for r in results]
    bound = theory * 8 / rate_bits(rate)
    return {
        "arm": arm,
        "ranks": ranks,
        "updates": len(results[0]["journal"]),
        "synchronizations": synchronizations,
        "loop_seconds": loop,
        "theory_bytes_per_rank": theory,
        "written_bytes": written,
        "written_over_theory": [round(w / theory, 4) for w in written],
        "private_interface_bytes_sent": interface,
        "link_bound_seconds": round(bound, 2),
        "loop_over_link_bound": round(max(loop) / bound, 3),
        "parameter_digest": results[0]["parameter_digest"],
    }


def _experiment(path: Path) -> dict[str, Any]:
    """The figures a recorded local-SGD report gives."""
    report = json.loads(path.read_text())
    local = report["local_sgd"]
    return {
        "accuracy": {arm: [a["overall"]["correct"], a["overall"]["n"]] for arm, a in report["accuracy"].items()},
        "noninferiority": local["noninferiority"],
        "retention_upper": {arm: r["upper"] for arm, r in local["retention"].items()},
        "verdict_passed": local["verdict"]["passed"],
        "written_over_theory": {arm: c["written_over_theory"] for arm, c in local["communication"].items()},
        "diloco_over_control_bytes": local["diloco_over_control_bytes"],
        "loop_seconds": {arm: t["loop_seconds"] for arm, t in report["training"].items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, default=ROOT / "plans" / "local-diloco.toml")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "seeds" / "tiny")
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--report", type=Path, help="a recorded report of the plan, on loopback (make run)")
    args = parser.parse_args()
    from experiment.core.plan import load_plan

    plan = load_plan(args.plan)
    control, diloco = plan.arm("control"), plan.arm("diloco")
    ranks = plan.world_size(control)
    rows = []
    with tempfile.TemporaryDirectory(prefix="coop-local-sgd-") as scratch, hosts(ranks, args.rate) as topology:
        home = Path(scratch) / "home"
        for host in topology["hosts"]:  # each host prepares its own copy, as an agent does
            coop = [sys.executable, "-m", "experiment.cli", "prepare", "--plan", str(args.plan)]
            coop += ["--home", str(home / host["name"]), "--model-dir", str(args.model_dir)]
            subprocess.run(coop, check=True, capture_output=True, cwd=ROOT)
        for arm in (control, diloco):
            every = plan.arm_plan(arm).sync_every or 1
            results = _train(topology, home, args.model_dir.resolve(), arm, ranks)
            row = _row(arm, results, plan.training.updates // every, plan.seed.parameters, args.rate)
            print(json.dumps({"event": "measured", **row}), file=sys.stderr, flush=True)
            rows.append(row)
    document = {
        "bench": "local-sgd",
        "plan": args.plan.name,
        "rate": args.rate,
        "rows": rows,
        "diloco_over_control_loop_seconds": round(max(rows[1]["loop_seconds"]) / max(rows[0]["loop_seconds"]), 4),
        "diloco_over_control_written_bytes": round(sum(rows[1]["written_bytes"]) / sum(rows[0]["written_bytes"]), 4),
    }
    if args.report is not None:
        document["make_run_report"] = _experiment(args.report)
    print(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
