"""Answers per second: greedy generation in left-padded batches vs one prompt at a time (the reference's
method), on this CPU, with the equality of every output id sequence. Prints one JSON object.

Usage: python bench/evaluate.py [--model-dir seeds/tiny] [--prompts 64] [--batch-size 16]"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from experiment.core import tasks
from experiment.learning import corpus, evaluation
from experiment.seed import seedmodel

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", type=Path, default=ROOT / "seeds" / "tiny")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=evaluation.BATCH_SIZE)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tokenizer = seedmodel.load_tokenizer(args.model_dir)
    model = seedmodel.load_model(args.model_dir).eval()
    eos, pad = int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token)), int(tokenizer.pad_token_id)
    prompts = [
        corpus.prompt_ids(tokenizer, tasks.render_prompt(tasks.make_case(2026091301, "test", i)))
        for i in range(args.prompts)
    ]

    began = time.perf_counter()
    alone = [evaluation.generate(model, [p], eos, pad, args.max_new_tokens)[0] for p in prompts]
    alone_seconds = time.perf_counter() - began

    began = time.perf_counter()
    batched = []
    for start in range(0, len(prompts), args.batch_size):
        batched += evaluation.generate(model, prompts[start : start + args.batch_size], eos, pad, args.max_new_tokens)
    batched_seconds = time.perf_counter() - began

    print(
        json.dumps(
            {
                "bench": "evaluate",
                "device": "cpu",
                "threads": 1,
                "model": str(args.model_dir),
                "prompts": len(prompts),
                "batch_size": args.batch_size,
                "max_new_tokens": args.max_new_tokens,
                "output_tokens": sum(len(g.output_ids) for g in alone),
                "answers_per_second_one_at_a_time": round(len(prompts) / alone_seconds, 3),
                "answers_per_second_batched": round(len(prompts) / batched_seconds, 3),
                "speedup": round(alone_seconds / batched_seconds, 3),
                "output_ids_equal": batched == alone,
                "differing_answers": sum(a != b for a, b in zip(alone, batched, strict=True)),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
