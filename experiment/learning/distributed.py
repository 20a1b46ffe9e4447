"""The process group from the torchrun environment, fixed-byte digest agreement and parameter digests.

Digests cross ranks as 32 raw bytes in a uint8 tensor through ``all_gather``: no pickle, no object
collectives anywhere."""

from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from experiment.core.errors import CoopError


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    master_addr: str
    master_port: int

    @property
    def distributed(self) -> bool:
        return self.size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise CoopError(f"{name}={raw!r} is not an integer") from exc


def world_from_env() -> World:
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torchrun and the agent set them."""
    size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if size < 1 or not 0 <= rank < size:
        raise CoopError(f"RANK={rank} and WORLD_SIZE={size} do not describe a rank of a world")
    return World(rank, size, os.environ.get("MASTER_ADDR", "127.0.0.1"), _env_int("MASTER_PORT", 29500))


# How long rank 0's store waits for its peers to join. A gang's ranks are claimed one by one, and a peer's host may
# finish another job first; the coordinator abandons a gang that does not form in time (it cancels the ranks), so
# this wait is only a backstop, and never the collectives' timeout.
RENDEZVOUS_SECONDS = 900.0


# How NCCL's watchdog ends a rank whose collective failed or outlived its timeout: it aborts the communicators (the
# GPU's pending collectives end) and then the process, by SIGABRT, which the agent reports lost as it does a gloo
# rank's exit EXIT_LINK. NCCL gives Python no exception to catch: its errors surface in the watchdog's thread.
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def start(world: World, backend: str, timeout_seconds: float) -> None:
    """The gang's process group: its rendezvous at MASTER_ADDR:MASTER_PORT (waiting RENDEZVOUS_SECONDS for the
    peers), then collectives that give up after ``timeout_seconds`` without their peers."""
    if world.distributed:
        if backend == "nccl":
            os.environ.update(NCCL_ERROR_HANDLING)  # read when the process group is made
        store = dist.TCPStore(  # type: ignore[attr-defined]
            world.master_addr,
            world.master_port,
            world.size,
            is_master=world.rank == 0,
            timeout=datetime.timedelta(seconds=RENDEZVOUS_SECONDS),
        )
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=world.rank,
            world_size=world.size,
            timeout=datetime.timedelta(seconds=timeout_seconds),
        )


def is_link_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective or the rendezvous failing for want of a peer: torch's distributed errors
    (store, network, backend), and gloo's transport errors (a timed-out receive, a connection closed or reset),
    which reach Python as plain RuntimeErrors naming gloo's transport."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo/transport" in str(error))


def stop(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def agree(world: World, label: str, digest: str, device: torch.device) -> None:
    """Every rank contributes one sha256 as 32 raw bytes; all must be equal, or every rank refuses."""
    if not world.distributed:
        return
    raw = bytes.fromhex(digest)
    if len(raw) != 32:
        raise CoopError(f"{label}: a digest must be 32 bytes of sha256, not {len(raw)}")
    mine = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    gathered = [torch.empty(32, dtype=torch.uint8, device=device) for _ in range(world.size)]
    dist.all_gather(gathered, mine)
    digests = [bytes(t.cpu().tolist()).hex() for t in gathered]
    if len(set(digests)) != 1:
        listing = ", ".join(f"rank {r}: {d[:16]}" for r, d in enumerate(digests))
        raise CoopError(f"ranks disagree on the {label} ({listing}); every rank aborts")


def parameter_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer's name, dtype, shape and raw bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def _all_reduce(world: World, value: torch.Tensor, op: dist.ReduceOp.RedOpType, device: torch.device) -> float:
    """One number reduced over every rank (the number itself in a world of one)."""
    if world.distributed:
        value = value.to(device)
        dist.all_reduce(value, op=op)
    return float(value.item())


def all_reduce_sum(world: World, value: float, device: torch.device) -> float:
    return _all_reduce(world, torch.tensor([value], dtype=torch.float64), dist.ReduceOp.SUM, device)


def any_rank(world: World, flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on some rank."""
    return bool(_all_reduce(world, torch.tensor([int(flag)], dtype=torch.int64), dist.ReduceOp.MAX, device))


def minimum(world: World, value: int, device: torch.device) -> int:
    """The smallest of every rank's ``value``."""
    return int(_all_reduce(world, torch.tensor([value], dtype=torch.int64), dist.ReduceOp.MIN, device))
