"""A DiLoCo worker for the DiLoCo tests: run as its own process with RANK / WORLD_SIZE / MASTER_*.

A small MLP (the same initial weights on every worker) trains on data that is a fixed function of the worker and
the inner step, with AdamW inside and experiment.learning.diloco's outer step every ``--every`` inner steps. It
saves its final parameters and the bytes it handed to the all-reduce; with ``--save-after`` it also saves its full
state after that outer round, and with ``--resume`` it starts from such a state."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from experiment.learning import distributed
from experiment.learning.diloco import OuterState

INNER_LEARNING_RATE = 1e-2
WEIGHT_DECAY = 0.01


def model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s data at inner step ``step`` (1-based), the same in every process that asks."""
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(5, 8, generator=generator), torch.randn(5, 4, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--outer-lr", type=float, required=True)
    parser.add_argument("--outer-momentum", type=float, required=True)
    parser.add_argument("--save-after", type=int)
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()
    world = distributed.world_from_env()
    distributed.start(world, "gloo", timeout_seconds=120)
    network = model()
    inner = torch.optim.AdamW(network.parameters(), lr=INNER_LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    first = 1
    if args.resume is not None:
        state = torch.load(args.resume / f"state-rank{world.rank}.pt", weights_only=True)
        network.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        first = state["round"] + 1
    outer = OuterState(list(network.parameters()), args.outer_lr, args.outer_momentum)
    if args.resume is not None:
        outer.load_state_dict(state["outer"])
    handed = 0
    for round_ in range(first, args.rounds + 1):
        for local in range(1, args.every + 1):
            x, y = batch(world.rank, (round_ - 1) * args.every + local)
            loss = torch.nn.functional.mse_loss(network(x), y)
            inner.zero_grad(set_to_none=True)
            loss.backward()
            inner.step()
        handed += outer.synchronize(world)
        if round_ == args.save_after:
            state = {"model": network.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}
            torch.save({**state, "round": round_}, args.out / f"state-rank{world.rank}.pt")
    save_file(
        {n: p.detach().clone() for n, p in network.named_parameters()},
        str(args.out / f"params-rank{world.rank}.safetensors"),
    )
    (args.out / f"handed-rank{world.rank}.json").write_text(json.dumps(handed))
    distributed.stop(world)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
