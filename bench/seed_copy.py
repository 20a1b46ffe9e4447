"""Does a candidate seed copy values from its context, and what does the local plan's fine-tune make of it?

Builds the committed seed's configuration (FULL, with the given changes) on the given device, measures exact
answers to held-out lookups in the seed's own schema, prepares the local plan's inputs on that seed, fine-tunes
clean-single through experiment.learning.training on the same device, and scores the seed and the fine-tuned
model on the 256 test tasks per family. Prints one JSON object; the seed stays in WORK/NAME/seed.

    .venv/bin/python bench/seed_copy.py --work /tmp/seeds --name longer --steps 6000 [--device cuda]
    .venv/bin/python bench/seed_copy.py --work /tmp/seeds --name committed --seed-dir seeds/tiny
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiment.core import tasks  # noqa: E402
from experiment.core.plan import load_plan  # noqa: E402
from experiment.learning import stats, training  # noqa: E402
from experiment.learning.answers import answer_text  # noqa: E402
from experiment.learning.corpus import load_prepared, prepare  # noqa: E402
from experiment.learning.decoding import generate  # noqa: E402
from experiment.learning.evaluation import batch_size_for, retention_score  # noqa: E402
from experiment.learning.receipts import model_dir as checkpoint_model_dir  # noqa: E402
from experiment.seed import seedmodel, tinyseed  # noqa: E402


def copy_accuracy(seed_dir: Path, device: str) -> dict[str, int]:
    """Held-out lookups the seed answers exactly in its own JSON styles (tinyseed.copy_probes)."""
    tokenizer = seedmodel.load_tokenizer(seed_dir)
    model = seedmodel.load_model(seed_dir).to(device)
    encoder = tinyseed.encoder_of(tokenizer)
    probes = tinyseed.copy_probes(encoder)
    pad = int(tokenizer.pad_token_id)
    return {f"copy_{style}": tinyseed.copied(model, rows, pad) for style, rows in probes.items()} | {
        "copy_probes": tinyseed.COPY_PROBES
    }


def family_scores(
    seed_dir: Path, weights_dir: Path, home: Path, device: str, role: Literal["dev", "test"]
) -> dict[str, dict[str, int]]:
    tokenizer = seedmodel.load_tokenizer(seed_dir)
    model = seedmodel.load_model(weights_dir).to(device)
    model.train(False)
    items = load_prepared(home).task_items(role)
    scores: dict[str, dict[str, int]] = {}
    for start in range(0, len(items), 64):
        batch = items[start : start + 64]
        prompts = [i.prompt_ids for i in batch]
        gens = generate(model, prompts, tokenizer.eos_token_id, tokenizer.pad_token_id, 96, batch_size_for(device))
        for item, gen in zip(batch, gens, strict=True):
            check = tasks.check(answer_text(tokenizer, gen), item.expected)
            score = scores.setdefault(item.family, {"n": 0, "correct": 0, "valid_json": 0})
            score["n"] += 1
            score["correct"] += check.correct
            score["valid_json"] += check.valid_json_object
    return scores


def retention_losses(weights_dir: Path, home: Path, device: str) -> dict[str, float]:
    """Mean nats per answer token of every retention probe, as the evaluation measures them."""
    model = seedmodel.load_model(weights_dir).to(device)
    model.train(False)
    return {probe.id: retention_score(model, probe).mean_nats for probe in load_prepared(home).probes()}


def plan_for(snapshot: seedmodel.Snapshot, device: str, learning_rate: float | None) -> str:
    """plans/local.toml with this seed's snapshot (and CUDA/nccl when the fine-tune runs on a GPU)."""
    text = (ROOT / "plans/local.toml").read_text(encoding="utf-8")
    files = "\n".join(f'"{name}" = "{digest}"' for name, digest in sorted(snapshot.files.items()))
    seed = (
        f'[seed]\nname = "coop-tiny-llama"\nrevision = "candidate"\nparameters = {snapshot.parameters}\n'
        f'tokenizer_identity = "{snapshot.tokenizer_identity}"\n\n[seed.files]\n{files}\n\n'
    )
    text = re.sub(r"\[seed\]\n.*?(?=\[replay\])", seed, text, flags=re.S)
    if learning_rate is not None:
        text = re.sub(r"(?m)^peak_learning_rate = .*$", f"peak_learning_rate = {learning_rate!r}", text)
    if device == "cuda":
        text = text.replace('device = "cpu"', 'device = "cuda"').replace('backend = "gloo"', 'backend = "nccl"')
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, help="pre-training steps (default: the configuration's)")
    parser.add_argument("--batch", type=int, help="sequences a step (default: the configuration's)")
    parser.add_argument("--finetune-lr", type=float, help="the fine-tune's peak learning rate (default: the plan's)")
    parser.add_argument("--seed-dir", type=Path, help="measure this built seed instead of building one")
    parser.add_argument("--lr", type=float, help="peak pre-training learning rate (default: the configuration's)")
    parser.add_argument("--conversation-every", type=int, help="every n-th step is conversations")
    parser.add_argument("--conversation-files", nargs="+", help="conversation files to pre-train on")
    args = parser.parse_args()
    if args.seed_dir is None:
        tinyseed.run_with_pinned_kernels()  # as `coop seed-model build` does: the same bytes as the command's build
    base = tinyseed.FULL
    steps = args.steps or base.pretrain_steps
    config = msgspec.structs.replace(
        base,
        pretrain_steps=steps,
        batch_size=args.batch or base.batch_size,
        peak_lr=args.lr or base.peak_lr,
        warmup_steps=max(base.warmup_steps, steps // 50),
        conversation_every=args.conversation_every or base.conversation_every,
        conversation_files=tuple(args.conversation_files or base.conversation_files),
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
        elif event.get("event") == "copy-probe":
            print(json.dumps(event), file=sys.stderr, flush=True)  # the build's progress, as it goes

    if args.seed_dir is None:
        snapshot = tinyseed.build_seed(seed_dir, config, progress=progress, root=ROOT)
        result["build_seconds"] = round(time.monotonic() - started, 1)
        result["final_loss_mean_50"] = round(sum(losses[-50:]) / len(losses[-50:]), 4)
    else:
        seed_dir = args.seed_dir.resolve()
        snapshot = seedmodel.snapshot_of(seed_dir)
        del result["config"]
    result["files"] = snapshot.files
    result.update(copy_accuracy(seed_dir, args.device))
    folder.mkdir(parents=True, exist_ok=True)
    plan_path = folder / "plan.toml"
    plan_path.write_text(plan_for(snapshot, args.device, args.finetune_lr), encoding="utf-8")
    # The plan names its replay folder relative to itself: give it the repository's.
    (folder / "local-reference").symlink_to(ROOT / "plans" / "local-reference")
    home = folder / "home"
    plan = load_plan(plan_path)
    prepare(plan, plan_path, home, seed_dir, None, lambda event: None)
    began = time.monotonic()
    trained = training.train(home, seed_dir, "clean-single", lambda event: None)
    if trained is None:
        raise SystemExit("the fine-tune stopped early")
    result["finetune_seconds"] = round(time.monotonic() - began, 1)
    weights = checkpoint_model_dir(training.run_dir(home, "clean-single", 0), trained.candidate)
    for role in ("dev", "test"):  # choose a learning rate on dev; test is what the local run will report
        result[f"seed_{role}"] = family_scores(seed_dir, seed_dir, home, args.device, role)
        result[f"clean_single_{role}"] = family_scores(seed_dir, weights, home, args.device, role)
    seed_losses = retention_losses(seed_dir, home, args.device)
    arm_losses = retention_losses(weights, home, args.device)
    bound = stats.retention_bound(seed_losses, arm_losses, plan.statistics.retention_z)
    result["retention"] = {
        "seed_mean_nats": round(sum(seed_losses.values()) / len(seed_losses), 4),
        "mean_change": round(bound.mean_change, 4),
        "upper": round(bound.upper, 4),
    }
    result["seconds"] = round(time.monotonic() - started, 1)
    result["torch"] = torch.__version__
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
