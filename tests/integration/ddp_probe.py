"""A training rank for the equivalence test: run as its own process with RANK / WORLD_SIZE / MASTER_*.

Saves the reduced gradients of the first update and the parameters after ``--updates`` updates."""

from __future__ import annotations

import argparse
import weakref
from pathlib import Path

import torch
from safetensors.torch import save_file

from experiment.learning import distributed, training, updates
from experiment.learning.corpus import load_prepared
from experiment.seed import seedmodel


def wrong_scale(world_size: int, weight: int, global_weighted_targets: int) -> float:
    """The negative control: forgets that DDP divides by world_size."""
    return weight / global_weighted_targets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--wrong-scale", action="store_true")
    args = parser.parse_args()
    prepared = load_prepared(args.home)
    plan = prepared.plan
    world = distributed.world_from_env()
    device = updates.configure_runtime(plan, world)
    distributed.start(world, plan.runtime.backend, timeout_seconds=120)
    model = seedmodel.load_model(args.model_dir).to(device)
    scale = wrong_scale if args.wrong_scale else updates.protocol_scale
    batches = training.schedule(plan)
    with updates.Trainer(plan, world, device, model, prepared.documents("train-clean"), scale=scale) as trainer:
        wrapper = weakref.ref(trainer.network)  # DDP on two ranks, the model itself on one
        for step in range(1, args.updates + 1):
            trainer.accumulate(batches[step - 1])
            if step == 1:
                grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
                save_file(grads, str(args.out / f"grads-rank{world.rank}.safetensors"))
            trainer.step(step)
    # Closed: DDP (and its reducer) is gone before the process group ends, so it cannot end it under the GIL.
    assert not world.distributed or wrapper() is None, "the trainer's DDP wrapper outlived close()"
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    save_file(params, str(args.out / f"params-rank{world.rank}.safetensors"))
    distributed.stop(world)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
