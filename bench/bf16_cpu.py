"""What bfloat16 would buy SmolLM2-135M on this CPU (it has AVX512-BF16), against the plan's float32: the seconds of
the training's forward and backward over the same prepared documents (float32 weights, the step's loss under
bfloat16 autocast, as a GPU plan runs it), and of greedy decoding of the same prompts with the weights cast to
bfloat16 (as a GPU plan's evaluation answers). Measured only: the pre-registered CPU numerics stay float32.

Usage: python bench/bf16_cpu.py --home PREPARED_HOME --seed-dir DIR [--documents 16] [--prompts 32] [--threads 1]
Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from experiment.learning import corpus, decoding, updates
from experiment.seed import seedmodel


def _train_seconds(seed_dir: Path, documents: list[Any], autocast: str) -> tuple[float, float]:
    model = seedmodel.load_model(seed_dir).train()
    start, total = time.perf_counter(), 0.0
    for document in documents:
        loss = updates.document_loss_sum(model, document, torch.device("cpu"), autocast)
        loss.backward()
        total += float(loss.detach())
    return time.perf_counter() - start, total


def _decode_seconds(seed_dir: Path, prompts: list[list[int]], dtype: torch.dtype, eos: int, pad: int) -> float:
    model = seedmodel.load_model(seed_dir).eval().to(dtype)
    start = time.perf_counter()
    with torch.inference_mode():
        decoding.generate(model, prompts, eos, pad, 96, batch_size=len(prompts))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, required=True, help="a prepared home of plans/smollm2-135m.toml")
    parser.add_argument("--seed-dir", type=Path, required=True)
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prepared = corpus.load_prepared(args.home)
    documents = prepared.documents("train-clean")[: args.documents]
    items = prepared.task_items("dev")[: args.prompts]
    tokenizer = seedmodel.load_tokenizer(args.seed_dir)
    eos, pad = int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token)), int(tokenizer.pad_token_id)
    prompts = [item.prompt_ids for item in items]
    train_fp32, loss_fp32 = _train_seconds(args.seed_dir, documents, "none")
    train_bf16, loss_bf16 = _train_seconds(args.seed_dir, documents, "bf16")
    decode_fp32 = _decode_seconds(args.seed_dir, prompts, torch.float32, eos, pad)
    decode_bf16 = _decode_seconds(args.seed_dir, prompts, torch.bfloat16, eos, pad)
    result = {
        "bench": "bf16_cpu",
        "threads": args.threads,
        "documents": len(documents),
        "document_tokens": sum(len(d.input_ids) for d in documents),
        "train_forward_backward_seconds": {"float32": round(train_fp32, 2), "bf16_autocast": round(train_bf16, 2)},
        "train_speedup": round(train_fp32 / train_bf16, 3),
        "loss_sum": {"float32": round(loss_fp32, 4), "bf16_autocast": round(loss_bf16, 4)},
        "prompts": len(prompts),
        "decode_seconds": {"float32": round(decode_fp32, 2), "bfloat16": round(decode_bf16, 2)},
        "decode_speedup": round(decode_fp32 / decode_bf16, 3),
    }
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
