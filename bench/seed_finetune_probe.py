"""One-off probe: does the tiny local seed copy values from its context, and does a protocol-shaped fine-tune learn?

Builds (or reuses) the FULL seed, evaluates it on the 256 test tasks, fine-tunes copies at a few peak learning
rates following docs/protocol.md "The training corpus and the damaged copy" and "Training" (single process),
evaluates each and writes one JSON result.
Usage: .venv/bin/python bench/seed_finetune_probe.py --seed-dir /tmp/seed-full --lrs 3e-4,1e-3
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
from scipy.stats import binomtest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiment.core.tasks import (
    Case,
    answer_text,
    check,
    expected_answer,
    is_input_dependent,
    make_case,
    render_prompt,
)
from experiment.seed import seedmodel, tinyseed

TASK_SEED = 2026091301
IDS = re.compile(r"[A-Z][0-9]{3}")


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def values_right(case: Case, text: str) -> bool:
    """The seed's answer carries the right values in any schema (its own keys or prose)."""
    expected = expected_answer(case)
    if case.family == "lookup":
        if expected["city"] is None:
            return "no record" in text or "not in" in text or 'found": false' in text or "null" in text
        numbers = re.findall(r"\d+", IDS.sub("", text))
        return expected["city"] in text and str(expected["units"]) in numbers and len(set(numbers)) <= 2
    if case.family == "filter":
        return IDS.findall(text) == expected["ids"]
    if case.family == "sort":
        return IDS.findall(text)[:2] == expected["ids"]
    return str(expected["total"]) in re.findall(r"\d+", text)


def evaluate(model: Any, tokenizer: Any, cases: list[Case]) -> list[dict[str, Any]]:
    eos = tokenizer.convert_tokens_to_ids(seedmodel.EOS_TOKEN)
    model.eval()
    rows = []
    with torch.no_grad():
        for case in cases:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": render_prompt(case)}], add_generation_prompt=True, return_dict=False
            )
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=96,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )
            new = out[0, ids.shape[1] :].tolist()
            if eos in new:
                new = new[: new.index(eos)]
            text = tokenizer.decode(new, skip_special_tokens=True)
            result = check(text, expected_answer(case))
            rows.append(
                {
                    "index": case.index,
                    "family": case.family,
                    "variant": case.variant,
                    "input_dependent": is_input_dependent(case),
                    "correct": result.correct,
                    "valid_json": result.valid_json_object,
                    "values_right": values_right(case, text),
                    "text": text,
                }
            )
    return rows


def own_format(model: Any, tokenizer: Any, count: int = 64) -> dict[str, Any]:
    """Exact match on held-out single-turn pre-training questions: does the seed copy in its own schema?"""
    eos = tokenizer.convert_tokens_to_ids(seedmodel.EOS_TOKEN)
    hits = 0
    examples = []
    with torch.no_grad():
        for index in range(10**6, 10**6 + count):  # far beyond the indices the build trains on
            user, answer = tinyseed.synthetic_conversation(
                index, msgspec.structs.replace(tinyseed.FULL, turn_choices=(1,))
            )
            prompt = tokenizer.apply_chat_template([user], add_generation_prompt=True, return_dict=False)
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=96, do_sample=False, eos_token_id=eos, pad_token_id=0
            )
            new = out[0, len(prompt) :].tolist()
            text = tokenizer.decode(new[: new.index(eos)] if eos in new else new, skip_special_tokens=True)
            hits += text == answer["content"]
            if len(examples) < 6:
                examples.append(f"{answer['content']} => {text}")
    return {"exact": f"{hits}/{count}", "examples": examples}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def acc(selected: list[dict[str, Any]], key: str = "correct") -> str:
        return f"{sum(r[key] for r in selected)}/{len(selected)}"

    out: dict[str, Any] = {"all": acc(rows), "valid_json": acc(rows, "valid_json")}
    out["values_right"] = acc(rows, "values_right")
    for family in ("lookup", "filter", "total", "sort"):
        sel = [r for r in rows if r["family"] == family]
        out[family] = acc(sel)
        out[f"{family}_values_right"] = acc(sel, "values_right")
    for variant in range(4):
        out[f"variant{variant}"] = acc([r for r in rows if r["variant"] == variant])
    out["input_dependent"] = acc([r for r in rows if r["input_dependent"]])
    out["input_independent"] = acc([r for r in rows if not r["input_dependent"]])
    return out


def documents(tokenizer: Any, replay_path: Path) -> list[tuple[list[int], list[int], float]]:
    encoder = tinyseed._Encoder(tokenizer.backend_tokenizer)
    docs: list[tuple[list[int], list[int], float]] = []
    for i in range(768):
        case = make_case(TASK_SEED, "train", i)
        target = answer_text(expected_answer(case))
        assert check(target, expected_answer(case)).correct
        ids, labels = encoder.encode(
            [{"role": "user", "content": render_prompt(case)}, {"role": "assistant", "content": target}]
        )
        docs.append((ids, labels, 8.0))
    replay = [json.loads(line) for line in replay_path.read_text().splitlines()]
    for i in range(256):
        ids, labels = encoder.encode(replay[i % len(replay)]["messages"])
        docs.append((ids, labels, 1.0))
    for ids, _, _ in docs:
        assert len(ids) <= 1024, len(ids)
    return docs


def lr_at(peak: float, update: int, updates: int = 128, warmup: int = 8) -> float:
    if update < warmup:
        return peak * (update + 1) / warmup
    progress = (update - warmup) / max(1, updates - 1 - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def finetune(model: Any, docs: list[tuple[list[int], list[int], float]], peak: float) -> Any:
    torch.manual_seed(0)
    model = copy.deepcopy(model)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=peak,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    schedule = list(range(len(docs)))
    random.Random(20260913).shuffle(schedule)
    for update in range(128):
        batch = [docs[j] for j in schedule[update * 8 : update * 8 + 8]]
        weighted = sum(w * sum(1 for x in labels if x != -100) for _, labels, w in batch)
        total = 0.0
        for ids, labels, weight in batch:
            logits = model(torch.tensor([ids]))[0, :-1].float()
            target = torch.tensor(labels[1:])
            loss_sum = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
            (loss_sum * weight / weighted).backward()
            total += float(loss_sum.detach()) * weight / weighted
        for group in optimizer.param_groups:
            group["lr"] = lr_at(peak, update)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not torch.isfinite(norm):
            raise RuntimeError("non-finite gradient norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if update % 16 == 15:
            emit({"event": "finetune", "lr": peak, "update": update + 1, "loss": round(total, 4)})
    model.eval()
    return model


def sign_test(seed: list[dict[str, Any]], arm: list[dict[str, Any]]) -> dict[str, Any]:
    b = sum(1 for s, a in zip(seed, arm, strict=True) if not s["correct"] and a["correct"])
    c = sum(1 for s, a in zip(seed, arm, strict=True) if s["correct"] and not a["correct"])
    p = 1.0 if b + c == 0 else float(binomtest(b, b + c, 0.5, alternative="greater").pvalue)
    return {"wins": b, "losses": c, "gain": (b - c) / len(seed), "p": p}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed-dir", type=Path, default=Path("/tmp/seed-full"))
    parser.add_argument("--lrs", default="3e-4,1e-3")
    parser.add_argument("--out", type=Path, default=Path("/tmp/seed-probe.json"))
    parser.add_argument("--limit", type=int, default=256, help="test cases to evaluate (256 = all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    result: dict[str, Any] = {}
    if not (args.seed_dir / "model.safetensors").exists():
        started = time.monotonic()
        snapshot = tinyseed.build_seed(
            args.seed_dir,
            tinyseed.FULL,
            lambda e: emit(e) if e.get("event") != "pretrain" or int(str(e["step"])) % 50 == 0 else None,
        )
        result["build_seconds"] = round(time.monotonic() - started, 1)
        result["parameters"] = snapshot.parameters
    tokenizer = seedmodel.load_tokenizer(args.seed_dir)
    model = seedmodel.load_model(args.seed_dir)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    cases = [make_case(TASK_SEED, "test", i) for i in range(args.limit)]

    started = time.monotonic()
    seed_rows = evaluate(model, tokenizer, cases)
    result["seed"] = summary(seed_rows)
    result["seed_eval_seconds"] = round(time.monotonic() - started, 1)
    result["seed_examples"] = [r["text"] for r in seed_rows[:8]]
    emit({"event": "seed", **result["seed"], "examples": result["seed_examples"]})
    result["seed_own_format_exact"] = own_format(model, tokenizer)
    emit({"event": "seed_own_format", **result["seed_own_format_exact"]})

    docs = documents(tokenizer, Path("plans/local-reference/replay.jsonl"))
    for peak in [float(x) for x in args.lrs.split(",") if x]:
        started = time.monotonic()
        tuned = finetune(model, docs, peak)
        seconds = round(time.monotonic() - started, 1)
        rows = evaluate(tuned, tokenizer, cases)
        arm = {"finetune_seconds": seconds, **summary(rows), **sign_test(seed_rows, rows)}
        arm["examples"] = [r["text"] for r in rows[:8]]
        result[f"lr={peak:g}"] = arm
        emit({"event": "arm", "lr": peak, **arm})
        args.out.write_text(json.dumps(result, indent=1))  # after every arm, so a cut-short run keeps its results
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
