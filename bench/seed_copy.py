"""Does a candidate seed copy values from its context, and what does the local plan's fine-tune make of it?

Builds the seed of one pre-training configuration (FULL with the given changes) on the given device, measures
exact answers to held-out lookups in the seed's own schema, prepares the local plan's inputs on that seed,
fine-tunes clean-single through experiment.training on the same device, and scores the seed and the fine-tuned
model on the 256 test tasks per family. Prints one JSON object; the seed stays in WORK/NAME/seed.

    .venv/bin/python bench/seed_copy.py --work /tmp/seeds --name longer --steps 16000 --restate 3 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiment import seedmodel, tasks, training  # noqa: E402
from experiment.checkpoint import model_dir as checkpoint_model_dir  # noqa: E402
from experiment.corpus import load_prepared, prepare  # noqa: E402
from experiment.evaluation import answer_text, generate  # noqa: E402
from experiment.plan import load_plan  # noqa: E402

PROBES = 128


def copy_probes() -> list[tuple[list[dict[str, str]], str]]:
    """Held-out lookups of present ids in the seed's own JSON style, from an RNG stream pre-training never uses."""
    out = []
    for index in range(PROBES):
        rng = random.Random(f"copy-probe:{index}")
        records = seedmodel._records(rng)
        query = rng.choice(records)
        table = seedmodel._table(records, ["city", "units"])
        ask = f"Table:\n{table}\n\nTell me the city and units for {query.id}. Use JSON."
        answer = seedmodel._dumps({"location": query.city, "count": query.units})
        out.append(([{"role": "user", "content": ask}], answer))
    return out


def copy_accuracy(seed_dir: Path, device: str) -> dict[str, int]:
    tokenizer = seedmodel.load_tokenizer(seed_dir)
    model = seedmodel.load_model(seed_dir).to(device)
    model.train(False)
    probes = copy_probes()
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m, _ in probes]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    exact = city = 0
    for start in range(0, len(ids), 64):
        gens = generate(model, ids[start : start + 64], tokenizer.eos_token_id, tokenizer.pad_token_id, 40)
        for gen, (_, want) in zip(gens, probes[start : start + 64], strict=True):
            text = answer_text(tokenizer, gen)
            exact += text == want
            city += want.split(",")[0] in text
    return {"copy_exact": exact, "copy_city": city, "copy_probes": len(probes)}


def family_scores(seed_dir: Path, weights_dir: Path, home: Path, device: str) -> dict[str, dict[str, int]]:
    tokenizer = seedmodel.load_tokenizer(seed_dir)
    model = seedmodel.load_model(weights_dir).to(device)
    model.train(False)
    items = load_prepared(home).task_items("test")
    scores: dict[str, dict[str, int]] = {}
    for start in range(0, len(items), 64):
        batch = items[start : start + 64]
        gens = generate(model, [i.prompt_ids for i in batch], tokenizer.eos_token_id, tokenizer.pad_token_id, 96)
        for item, gen in zip(batch, gens, strict=True):
            check = tasks.check(answer_text(tokenizer, gen), item.expected)
            score = scores.setdefault(item.family, {"n": 0, "correct": 0, "valid_json": 0})
            score["n"] += 1
            score["correct"] += check.correct
            score["valid_json"] += check.valid_json_object
    return scores


def plan_for(snapshot: seedmodel.Snapshot, device: str) -> str:
    """plans/local.toml with this seed's snapshot (and CUDA/nccl when the fine-tune runs on a GPU)."""
    text = (ROOT / "plans/local.toml").read_text(encoding="utf-8")
    files = "\n".join(f'"{name}" = "{digest}"' for name, digest in sorted(snapshot.files.items()))
    seed = (
        f'[seed]\nname = "coop-tiny-llama"\nrevision = "candidate"\nparameters = {snapshot.parameters}\n'
        f'tokenizer_identity = "{snapshot.tokenizer_identity}"\n\n[seed.files]\n{files}\n\n'
    )
    text = re.sub(r"\[seed\]\n.*?(?=\[replay\])", seed, text, flags=re.S)
    if device == "cuda":
        text = text.replace('device = "cpu"', 'device = "cuda"').replace('backend = "gloo"', 'backend = "nccl"')
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=seedmodel.FULL.pretrain_steps)
    parser.add_argument("--batch", type=int, default=seedmodel.FULL.batch_size)
    parser.add_argument("--restate", type=int, default=seedmodel.FULL.restate_weight)
    parser.add_argument("--lr", type=float, default=seedmodel.FULL.peak_lr)
    args = parser.parse_args()
    config = msgspec.structs.replace(
        seedmodel.FULL,
        pretrain_steps=args.steps,
        batch_size=args.batch,
        restate_weight=args.restate,
        peak_lr=args.lr,
        warmup_steps=max(seedmodel.FULL.warmup_steps, args.steps // 60),
        device=args.device,
    )
    folder = args.work / args.name
    seed_dir = folder / "seed"
    result: dict[str, Any] = {"name": args.name, "config": msgspec.to_builtins(config)}
    losses: list[float] = []
    started = time.monotonic()

    def progress(event: dict[str, object]) -> None:
        if event.get("event") == "pretrain":
            losses.append(float(event["loss"]))  # type: ignore[arg-type]

    snapshot = seedmodel.build_seed(seed_dir, config, progress=progress, root=ROOT)
    result["build_seconds"] = round(time.monotonic() - started, 1)
    result["final_loss_mean_50"] = round(sum(losses[-50:]) / len(losses[-50:]), 4)
    result["files"] = snapshot.files
    result.update(copy_accuracy(seed_dir, args.device))
    plan_path = folder / "plan.toml"
    plan_path.write_text(plan_for(snapshot, args.device), encoding="utf-8")
    # The plan names its replay folder relative to itself: give it the repository's.
    (folder / "local-reference").symlink_to(ROOT / "plans" / "local-reference")
    home = folder / "home"
    prepare(load_plan(plan_path), plan_path, home, seed_dir, None, lambda event: None)
    began = time.monotonic()
    trained = training.train(home, seed_dir, "clean-single", lambda event: None)
    if trained is None:
        raise SystemExit("the fine-tune stopped early")
    result["finetune_seconds"] = round(time.monotonic() - began, 1)
    weights = checkpoint_model_dir(training.run_dir(home, "clean-single", 0), trained.candidate)
    result["seed_test"] = family_scores(seed_dir, seed_dir, home, args.device)
    result["clean_single_test"] = family_scores(seed_dir, weights, home, args.device)
    result["seconds"] = round(time.monotonic() - started, 1)
    result["torch"] = torch.__version__
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
