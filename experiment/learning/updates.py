"""One update, as the protocol reads it: the learning-rate curve, the token-weighted update on one or N ranks (the
Trainer), and the runtime it runs in.

Per document one forward pass (batch of 1), summed FP32 token cross-entropy, backward of
``loss_sum x world_size x weight / global_weighted_targets``; DDP's average then equals the global token-weighted
objective. Clipping and AdamW come after the reduction. A rank's whole run, with its checkpoints and result, is
experiment.learning.training's."""

from __future__ import annotations

import contextlib
import gc
import math
import os
from collections.abc import Callable

import msgspec
import torch
from torch.nn.parallel import DistributedDataParallel

from experiment.core import determinism
from experiment.core.errors import CoopError
from experiment.core.plan import ArmPlan, Plan
from experiment.learning import distributed
from experiment.learning.corpus import Document
from experiment.learning.diloco import OuterState
from experiment.learning.distributed import World
from experiment.learning.records import Communication

LossScale = Callable[[int, int, int], float]


def protocol_scale(world_size: int, weight: int, global_weighted_targets: int) -> float:
    """The factor on a document's summed loss: DDP divides by world_size, so it is multiplied back."""
    return world_size * weight / global_weighted_targets


def local_positions(batch: list[int], world: World) -> list[int]:
    """Rank r takes global positions r, r + W, r + 2W, ... of the batch."""
    return batch[world.rank :: world.size]


def learning_rate(plan: Plan, step: int) -> float:
    """Step counts from 1: linear warmup to the peak, then cosine down to the final fraction at the last."""
    training = plan.training
    peak = training.peak_learning_rate
    if step <= training.warmup_updates:
        return peak * step / training.warmup_updates
    floor = peak * training.final_learning_rate_fraction
    progress = (step - training.warmup_updates) / (training.updates - training.warmup_updates)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, list[torch.nn.Parameter] | float]]:
    """Weight decay on tensors with ndim >= 2 only."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


# The variable that pins each backend's sockets to one interface (the agent sets both for a host's private link).
SOCKET_INTERFACE = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def communication_profile(device: torch.device, backend: str) -> Communication:
    """How a rank's collectives run: the interface they are pinned to (None: the backend chooses), NCCL's version
    on CUDA, and every NCCL_*, TORCH_NCCL_* and GLOO_* variable (NCCL's error handling among them). Recorded beside
    the numerical profile, not in the binding, since an interface's name may differ between hosts."""
    nccl = None
    if device.type == "cuda":
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        nccl = ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)
    return {
        "interface": os.environ.get(SOCKET_INTERFACE[backend]),
        "nccl": nccl,
        "environment": {
            name: value
            for name, value in sorted(os.environ.items())
            if name.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_"))
        },
    }


def configure_runtime(plan: Plan, world: World) -> torch.device:
    """The rank's device, deterministic, with the plan's threads (core.determinism)."""
    if plan.runtime.device == "cuda" and not torch.cuda.is_available():
        raise CoopError("the plan asks for cuda, and no CUDA device is visible")
    determinism.make_deterministic(plan.runtime.device, plan.runtime.cpu_threads)
    if plan.runtime.device == "cuda":
        device = torch.device("cuda", world.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def document_loss_sum(model: torch.nn.Module, document: Document, device: torch.device, autocast: str) -> torch.Tensor:
    """Summed token cross-entropy in FP32 over the labelled (answer) tokens of one document.

    The vocabulary's logits are computed only where a label follows (the position before each answer token): the
    prompt's positions add nothing to the loss or its gradient, and their logits (49,152 a position for SmolLM2)
    would cost an eighth of a 135M model's update on a CPU."""
    input_ids = torch.tensor([document.input_ids], dtype=torch.long, device=device)
    labels = torch.tensor(document.labels[1:], dtype=torch.long, device=device)
    labelled = torch.nonzero(labels != -100).flatten()
    cast = torch.autocast(device.type, dtype=torch.bfloat16) if autocast == "bf16" else contextlib.nullcontext()
    with cast:
        logits = model(input_ids, logits_to_keep=labelled)
    return torch.nn.functional.cross_entropy(logits[0].float(), labels[labelled], reduction="sum")


class Update(msgspec.Struct, frozen=True):
    loss: float  # the global token-weighted mean loss of the batch, nats per weighted target
    targets: int
    weighted_targets: int
    documents: int


# DDP's gradient buckets: one for the whole model (the 1.7B seed's 6.85 GB of gradients fit in 7). Its all-reduce
# starts once the last document's backward is done; smaller buckets would start earlier (bench/private_link.py
# measures what that overlap is worth).
BUCKET_CAP_MB = 1024


def wrap_ddp(
    model: torch.nn.Module, device: torch.device, bucket_cap_mb: int = BUCKET_CAP_MB
) -> DistributedDataParallel:
    """``model`` as a rank of a synchronous DDP gang (the process group must be started)."""
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        forward_sync_buffers=False,  # no buffer is trained; the rotary tables are equal by construction
        gradient_as_bucket_view=True,
        bucket_cap_mb=bucket_cap_mb,
    )


class Trainer:
    """One rank's model, optimizer and documents; ``accumulate`` then ``step`` is one update."""

    def __init__(
        self,
        plan: Plan,
        world: World,
        device: torch.device,
        model: torch.nn.Module,
        documents: list[Document],
        scale: LossScale = protocol_scale,
        arm: ArmPlan | None = None,
    ) -> None:
        self.plan = plan
        self.world = world
        self.device = device
        self.model = model
        self.documents = documents
        self.scale = scale
        # A DiLoCo arm's workers each step on their own gradients, and meet only at the outer step every
        # ``sync_every`` updates; every other arm of more than one rank reduces its gradients every update (DDP).
        self.outer: OuterState | None = None
        self.sync_every = 1
        self.handed_bytes = 0  # to the outer step's all-reduce
        if arm is not None and arm.diloco:
            assert arm.sync_every and arm.outer_learning_rate and arm.outer_momentum is not None  # the plan's rule
            self.outer = OuterState(list(model.parameters()), arm.outer_learning_rate, arm.outer_momentum)
            self.sync_every = arm.sync_every
        self.network: torch.nn.Module = wrap_ddp(model, device) if world.distributed and self.outer is None else model
        training = plan.training
        self.optimizer = torch.optim.AdamW(
            parameter_groups(model, training.weight_decay),
            lr=learning_rate(plan, 1),
            betas=(training.adam_beta1, training.adam_beta2),
            eps=training.adam_epsilon,
        )

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Free DDP's reducer while the process group still lives. The reducer must never hold the group's last
        reference: freeing it then (with the GIL held) joins gloo's worker threads, one of which may be waiting
        for the GIL to free a finished all-reduce, and the rank hangs at exit (seen with torch 2.13 on CPU)."""
        if isinstance(self.network, DistributedDataParallel):
            self.network = self.model
            gc.collect()  # the reducer's autograd hooks form reference cycles

    def _no_sync(self) -> contextlib.AbstractContextManager[None]:
        if isinstance(self.network, DistributedDataParallel):
            return self.network.no_sync()
        return contextlib.nullcontext()

    def accumulate(self, batch: list[int]) -> Update:
        """Forward and backward every local document; the last one outside no_sync, so DDP reduces once."""
        weighted = sum(self.documents[p].targets * self.documents[p].weight for p in batch)
        if weighted == 0:
            raise CoopError(f"the batch {batch} has no target tokens")
        mine = local_positions(batch, self.world)
        local_loss = 0.0
        for number, position in enumerate(mine):
            document = self.documents[position]
            last = number == len(mine) - 1
            with contextlib.nullcontext() if last else self._no_sync():
                loss_sum = document_loss_sum(self.network, document, self.device, self.plan.runtime.autocast)
                torch.autograd.backward(loss_sum * self.scale(self.world.size, document.weight, weighted))
            local_loss += float(loss_sum.detach()) * document.weight
        total = distributed.all_reduce_sum(self.world, local_loss, self.device)
        return Update(
            loss=total / weighted,
            targets=sum(self.documents[p].targets for p in batch),
            weighted_targets=weighted,
            documents=len(mine),
        )

    def step(self, step: int) -> tuple[float, float]:
        """Clip the reduced gradients, apply AdamW at this step's learning rate; returns (lr, grad norm)."""
        rate = learning_rate(self.plan, step)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.plan.training.clip_norm))
        if not math.isfinite(norm):
            raise CoopError(f"update {step}: the gradient norm is {norm}; training aborts")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.outer is not None and step % self.sync_every == 0:
            self.handed_bytes += self.outer.synchronize(self.world)
        return rate, norm

    def outer_steps(self, step: int) -> int:
        """The outer steps up to and including ``step`` (none for an arm that synchronizes every update)."""
        return step // self.sync_every if self.outer is not None else 0
