"""DiLoCo's outer loop (Douillard et al. 2023, arXiv 2311.08105) on torch.distributed.

Each worker trains its own copy of the model with its inner optimizer for H steps, from the outer parameters
every worker shares. Then, once per H inner steps, every worker:

    delta    = mean over workers of (outer - theta_worker)     # the pseudo-gradient: one all-reduce
    momentum = mu * momentum + delta
    outer    = outer - lr * (delta + mu * momentum)            # Nesterov's step
    theta_worker = outer                                       # every worker starts the next round from it

which is torch.optim.SGD(lr, momentum=mu, nesterov=True) taking one step on ``outer`` with ``delta`` as its
gradient. The inner optimizer's state stays each worker's own. The all-reduce moves the bytes of one DDP update
(2 (N-1)/N x 4 B x parameters per worker), once per H updates instead of every update.

A worker's full state at an outer step is its model (equal to ``outer`` just after the step), its inner optimizer,
its RNG, and the outer momentum (``state_dict``); a run resumes only at an outer step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from experiment.core.errors import CoopError
from experiment.learning.distributed import World


class OuterState:
    """The outer parameters (the weights every worker last synchronized to) and the outer Nesterov momentum."""

    def __init__(self, parameters: list[torch.nn.Parameter], learning_rate: float, momentum: float) -> None:
        if not parameters:
            raise CoopError("DiLoCo needs parameters to synchronize")
        self.learning_rate = learning_rate
        self.momentum = momentum
        self.parameters = parameters
        self.outer = [p.detach().clone() for p in parameters]
        self.buffers = [torch.zeros_like(p) for p in parameters]

    @torch.no_grad()
    def synchronize(self, world: World) -> int:
        """The outer step: every worker's parameters become the new outer parameters. Returns the bytes each
        worker handed to the all-reduce: every pseudo-gradient in one flat tensor, one all-reduce."""
        deltas = [outer - parameter for parameter, outer in zip(self.parameters, self.outer, strict=True)]
        flat = torch.cat([delta.reshape(-1) for delta in deltas])  # this worker's pseudo-gradient
        if world.distributed:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world.size)
        offset = 0
        for parameter, outer, buffer in zip(self.parameters, self.outer, self.buffers, strict=True):
            delta = flat[offset : offset + parameter.numel()].view_as(parameter)
            offset += parameter.numel()
            buffer.mul_(self.momentum).add_(delta)
            outer.sub_(delta.add(buffer, alpha=self.momentum), alpha=self.learning_rate)
            parameter.copy_(outer)
        return flat.numel() * flat.element_size() if world.distributed else 0

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        """The momentum (the outer parameters are the model's weights at an outer step, saved with it)."""
        return {"momentum": [b.detach().clone() for b in self.buffers]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Resume at an outer step: the outer parameters are the model's, the momentum the saved one."""
        momentum = state.get("momentum")
        if momentum is None or len(momentum) != len(self.buffers):
            raise CoopError("the outer state holds no momentum for every parameter; it is not this model's")
        for buffer, saved in zip(self.buffers, momentum, strict=True):
            if saved.shape != buffer.shape or saved.dtype != buffer.dtype:
                raise CoopError(f"the outer momentum {tuple(saved.shape)} {saved.dtype} is not this model's")
            buffer.copy_(saved)
        for outer, parameter in zip(self.outer, self.parameters, strict=True):
            outer.copy_(parameter)
