"""Answers per second on this CPU: the evaluation's batched greedy decoding (experiment.learning.decoding.generate)
against the reference's method, Hugging Face generate on one prompt at a time, on the same prompts, with the
equality of every output id sequence, for each of --batch-sizes; the evaluation's own CPU batch size
(evaluation.batch_size_for) heads the result. The prompts are the local plan's 256 test tasks, which the evaluation
passes to generate in one chunk. Each round times both methods, alternately; a speedup compares each method's
fastest round, as other work on the machine only slows a round down. Prints one JSON object and writes it to --out.

Usage: python bench/evaluate.py [--model-dir seeds/tiny] [--prompts 256] [--batch-sizes 32,64,128] [--rounds 3]"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiment.core import tasks  # noqa: E402
from experiment.learning import corpus, decoding, evaluation  # noqa: E402
from experiment.seed import seedmodel, seedtokenizer  # noqa: E402
from tests.support.greedy import hf_greedy as one_at_a_time  # noqa: E402  (the reference's method)
from tests.support.greedy import hf_model  # noqa: E402


def _timed(run: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    began = time.perf_counter()
    ids = run()
    return time.perf_counter() - began, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", type=Path, default=ROOT / "seeds" / "tiny")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--batch-sizes", default="32,64,128")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="the plans' cpu_threads is 1")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "evaluate-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    tokenizer = seedtokenizer.read_tokenizer(args.model_dir)
    model = seedmodel.load_model(args.model_dir).eval()
    reference_model = hf_model(args.model_dir)  # the reference's method runs transformers' own model
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    prompts = [
        corpus.prompt_ids(tokenizer, tasks.render_prompt(tasks.make_case(2026091301, "test", i)))
        for i in range(args.prompts)
    ]
    chosen = evaluation.batch_size_for("cpu")
    batch_sizes = sorted({chosen, *(int(size) for size in args.batch_sizes.split(","))})

    def alone() -> list[list[int]]:
        return [one_at_a_time(reference_model, p, eos, pad, args.max_new_tokens) for p in prompts]

    def batched(size: int) -> Callable[[], list[list[int]]]:
        def run() -> list[list[int]]:
            generations = decoding.generate(model, prompts, eos, pad, args.max_new_tokens, batch_size=size)
            return [g.output_ids for g in generations]

        return run

    alone_seconds: list[float] = []
    batched_seconds: dict[int, list[float]] = {size: [] for size in batch_sizes}
    differing = dict.fromkeys(batch_sizes, 0)
    for _ in range(args.rounds):
        seconds, reference = _timed(alone)
        alone_seconds.append(seconds)
        for size in batch_sizes:
            seconds, ids = _timed(batched(size))
            batched_seconds[size].append(seconds)
            differing[size] = max(differing[size], sum(a != b for a, b in zip(reference, ids, strict=True)))

    best_alone = min(alone_seconds)
    by_size = {
        size: {
            "answers_per_second_batched": round(len(prompts) / min(seconds), 3),
            "speedup": round(best_alone / min(seconds), 3),
            "output_ids_equal": differing[size] == 0,
            "differing_answers": differing[size],
            "round_seconds": [round(s, 3) for s in seconds],
        }
        for size, seconds in batched_seconds.items()
    }
    result = {
        "bench": "evaluate",
        "device": "cpu",
        "threads": args.threads,
        "model": str(args.model_dir.relative_to(ROOT) if args.model_dir.is_relative_to(ROOT) else args.model_dir),
        "prompts": len(prompts),
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "max_new_tokens": args.max_new_tokens,
        "output_tokens": sum(len(ids) for ids in reference),
        "rounds": args.rounds,
        "answers_per_second_one_at_a_time": round(len(prompts) / best_alone, 3),
        "one_at_a_time_round_seconds": [round(s, 3) for s in alone_seconds],
        "batch_size": chosen,
        **{k: v for k, v in by_size[chosen].items() if k != "round_seconds"},
        "fastest_batch_size": max(batch_sizes, key=lambda size: by_size[size]["speedup"]),
        "by_batch_size": {str(size): values for size, values in by_size.items()},
    }
    text = json.dumps(result, indent=2)
    print(text)
    args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
