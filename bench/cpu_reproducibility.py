"""What decides a CPU rank's arithmetic, measured: the first updates of SmolLM2-135M's clean-single arm (the
production Trainer, the committed bundle's prepared documents, one thread, deterministic mode), each in a fresh
process under one setting of MKL's conditional numerical reproducibility, oneDNN's ISA cap or ATen's CPU
capability. Each variant's losses, gradient norms, final parameter digest and seconds per update; whether it agrees
bit for bit with the default; and what it costs.

    .venv/bin/python bench/cpu_reproducibility.py --seed DIR [--updates 2]

``--seed`` is the staged SmolLM2-135M folder (`coop seed-model stage --plan plans/smollm2-135m.toml --cache DIR`).
Two machines of different CPU models are not at hand here: ATEN_CPU_CAPABILITY and the MKL/oneDNN ISA caps run
another machine class's kernels on this one, which shows which settings move the digest, not whether two real
machines agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "bench" / "results" / "smollm2-135m" / "evidence.tar.gz"
PLAN = ROOT / "plans" / "smollm2-135m.toml"
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "default, a second process": {},
    "MKL_CBWR=AVX512,STRICT": {"MKL_CBWR": "AVX512,STRICT"},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ATEN_CPU_CAPABILITY=avx2, MKL_CBWR=AVX2,STRICT": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"},
}
CLEARED = ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA")


def one(seed: Path, home: Path, updates: int) -> dict[str, object]:
    """This process's run: the production Trainer on the arm's documents, ``updates`` updates of the schedule."""
    import torch

    from experiment.core import determinism
    from experiment.learning import distributed, training
    from experiment.learning.corpus import load_prepared
    from experiment.learning.profile import numerical_profile
    from experiment.learning.schedule import schedule
    from experiment.learning.updates import Trainer
    from experiment.seed import seedmodel

    prepared = load_prepared(home)
    plan = prepared.plan
    determinism.make_deterministic("cpu", plan.runtime.cpu_threads)
    device = torch.device("cpu")
    model = seedmodel.load_model(seed)
    model.train()
    world = distributed.World(0, 1, "127.0.0.1", 29500)
    trainer = Trainer(plan, world, device, model, training.documents_for(prepared, "clean-single"))
    losses, norms, seconds = [], [], []
    for step, batch in enumerate(schedule(plan)[:updates], start=1):
        began = time.perf_counter()
        update = trainer.accumulate(batch)
        _, norm = trainer.step(step)
        seconds.append(time.perf_counter() - began)
        losses.append(update.loss)
        norms.append(norm)
    return {
        "losses": [repr(x) for x in losses],
        "gradient_norms": [repr(x) for x in norms],
        "parameter_digest": distributed.parameter_digest(model),
        "median_update_seconds": round(statistics.median(seconds), 3),
        "profile": numerical_profile(plan, device),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=Path, required=True)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu-reproducibility.json")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a child: the home to train from
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.seed, args.one, args.updates)))
        return 0
    with tempfile.TemporaryDirectory() as folder:
        home = Path(folder)
        with tarfile.open(BUNDLE) as bundle:
            members = [m for m in bundle.getmembers() if m.name.startswith("./prepared/")]
            bundle.extractall(home, members=members, filter="data")
        base = {k: v for k, v in os.environ.items() if k not in CLEARED} | {"HF_HUB_OFFLINE": "1"}
        results: dict[str, dict[str, object]] = {}
        for name, env in VARIANTS.items():
            print(json.dumps({"event": "variant", "name": name}), file=sys.stderr, flush=True)
            argv = [sys.executable, __file__, "--seed", str(args.seed), "--updates", str(args.updates)]
            done = subprocess.run(
                [*argv, "--one", str(home)], env=base | env, capture_output=True, text=True, cwd=ROOT, check=True
            )
            results[name] = {"environment": env, **json.loads(done.stdout.splitlines()[-1])}
    default = results["default"]
    for result in results.values():
        result["equals_default"] = all(
            result[k] == default[k] for k in ("losses", "gradient_norms", "parameter_digest")
        )
        result["cost_vs_default"] = round(
            float(result["median_update_seconds"]) / float(default["median_update_seconds"]),
            3,  # type: ignore[arg-type]
        )
    summary = {
        "what": "SmolLM2-135M clean-single, the first updates of the schedule, each variant in a fresh process",
        "updates": args.updates,
        "machine": {
            k: v for k, v in default["profile"].items() if k.startswith("cpu") or k in ("blas", "mkl", "onednn")
        },  # type: ignore[union-attr]
        "variants": results,
    }
    args.out.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    for name, result in results.items():
        print(f"{name:<48} equal={result['equals_default']!s:<5} {result['median_update_seconds']} s/update")
    return 0


if __name__ == "__main__":
    sys.exit(main())
