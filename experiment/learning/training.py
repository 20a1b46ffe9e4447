"""Training, as the protocol reads: the schedule, the learning-rate curve, the token-weighted update on
one or N ranks, checkpoints on every rank, and the run with its result file.

The update: per document one forward pass (batch of 1), summed FP32 token cross-entropy, backward of
``loss_sum x world_size x weight / global_weighted_targets``; DDP's average then equals the global
token-weighted objective. Clipping and AdamW come after the reduction."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import torch
from torch.nn.parallel import DistributedDataParallel

from experiment.core import determinism, layout
from experiment.core.canonical import identity, read_json, write_new_json
from experiment.core.errors import CoopError, LinkError
from experiment.core.plan import ArmPlan, Plan
from experiment.core.progress import Emit
from experiment.learning import checkpoint, distributed, preflight, receipts
from experiment.learning.corpus import Document, Prepared, load_prepared, seed_snapshot
from experiment.learning.diloco import OuterState
from experiment.learning.distributed import World
from experiment.learning.events import CompletedEvent
from experiment.learning.profile import check_shared, numerical_profile, shared
from experiment.learning.records import Communication, NetworkCounters, NumericalProfile, Pointer, Result, StepRecord
from experiment.learning.resources import Sampler, network_counters, written_bytes
from experiment.learning.schedule import schedule
from experiment.seed import seedfiles, seedmodel

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


def _clock(device: torch.device) -> float:
    """The time once the device has done what was queued on it (CUDA runs the optimizer's step asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic()


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


# A DiLoCo checkpoint's outer state (experiment.learning.diloco), beside the inner optimizer's.
OUTER = "outer.pt"

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
        if arm is not None and arm.role == "diloco":
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


class RunRecord(msgspec.Struct, frozen=True):
    """Written once when a rank's run first starts; a resume keeps its original deadline."""

    arm: str
    rank: int
    world_size: int
    binding: str
    started_at: str
    deadline_at: str


def run_dir(home: Path, arm: str, rank: int) -> Path:
    return home / layout.run(arm, rank)


def documents_for(prepared: Prepared, arm: str) -> list[Document]:
    return prepared.documents(prepared.plan.training_documents(arm))


def check_world(plan: Plan, arm: str, world: World) -> None:
    plan.training_documents(arm)  # refuses an arm the plan lacks, and the untouched seed
    wanted = plan.world_size(arm)
    if world.size != wanted:
        raise CoopError(f"arm {arm} runs with WORLD_SIZE={wanted}, not {world.size}")


def _run_record(directory: Path, arm: str, world: World, binding: str, plan: Plan) -> RunRecord:
    path = directory / "run.json"
    if path.exists():
        record = msgspec.convert(read_json(path), type=RunRecord)
        if record.binding != binding:
            raise CoopError(
                f"{directory} was started with binding {record.binding[:16]}, this run is "
                f"{binding[:16]}; use a fresh home for different inputs or settings"
            )
        return record
    now = datetime.now(UTC)
    record = RunRecord(
        arm=arm,
        rank=world.rank,
        world_size=world.size,
        binding=binding,
        started_at=now.isoformat(),
        deadline_at=(now + timedelta(hours=plan.training.deadline_hours)).isoformat(),
    )
    write_new_json(path, msgspec.to_builtins(record))
    return record


def _check_journal(journal: list[StepRecord], batches: list[list[int]], source: str) -> None:
    for number, record in enumerate(journal, start=1):
        if record.step != number or record.positions != batches[number - 1]:
            raise CoopError(f"{source}: journal entry {number} is not the schedule's update {number}")


def _sampler(run: _Run) -> Sampler:
    """The rank's resource sampler: on a GPU it also reads the memory torch holds there, beside the preflight's."""
    if run.device.type != "cuda":
        return Sampler()
    device = run.device
    return Sampler(
        gpu_allocated=lambda: torch.cuda.memory_allocated(device),
        preflight_bytes=preflight.memory_needed(run.plan, run.world.size),
    )


def _peak_memory(device: torch.device, sampler: Sampler) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    return sampler.peak_rss_bytes, "process peak rss (sampled)"


@contextlib.contextmanager
def _process_group(world: World, plan: Plan) -> Iterator[None]:
    distributed.start(world, plan.runtime.backend, timeout_seconds=plan.runtime.collective_timeout_seconds)
    try:
        yield
    finally:
        distributed.stop(world)


@dataclass(frozen=True)
class _Run:
    """One rank's run of an arm as it is bound before its process group starts: the inputs, the device, the
    schedule and the binding every rank must agree on."""

    prepared: Prepared
    arm: str
    world: World
    model_dir: Path
    directory: Path
    device: torch.device
    documents: list[Document]
    batches: list[list[int]]
    profile: NumericalProfile
    binding: str

    @property
    def plan(self) -> Plan:
        return self.prepared.plan


@dataclass
class _Progress:
    """Where a rank's run stands: its model, the checkpoints it found, its journal and its latest checkpoint."""

    model: torch.nn.Module
    held: receipts.Held
    tensor_layout: seedfiles.TensorLayout
    pointer: Pointer | None
    journal: list[StepRecord]
    resumed_from_step: int


def _bind_run(home: Path, model_dir: Path, arm: str) -> _Run:
    """Everything checked and computed before the process group starts."""
    prepared = load_prepared(home)
    plan = prepared.plan
    world = distributed.world_from_env()
    check_world(plan, arm, world)
    directory = run_dir(home, arm, world.rank)
    seedfiles.verify_seed(model_dir, seed_snapshot(plan))
    device = configure_runtime(plan, world)
    preflight.check_memory(plan, world.size, device)
    documents = documents_for(prepared, arm)
    batches = schedule(plan)
    profile = numerical_profile(plan, device)
    binding = identity(
        {"prepared": prepared.identity, "profile": shared(profile), "arm": arm, "world_size": world.size}
    )
    return _Run(
        prepared=prepared,
        arm=arm,
        world=world,
        model_dir=model_dir,
        directory=directory,
        device=device,
        documents=documents,
        batches=batches,
        profile=profile,
        binding=binding,
    )


def _start(run: _Run) -> RunRecord:
    """Every rank agrees on the binding; the run's record is written on its first start, and a resume past the
    record's deadline is refused."""
    check_shared(run.world, run.profile, run.device)  # names a differing field; the binding's digest then agrees
    distributed.agree(run.world, "binding (prepared inputs, numerical profile, arm, world)", run.binding, run.device)
    record = _run_record(run.directory, run.arm, run.world, run.binding, run.plan)
    if datetime.now(UTC) > datetime.fromisoformat(record.deadline_at):
        raise CoopError(f"the run's deadline {record.deadline_at} has passed; it will not resume")
    return record


def _resume(run: _Run) -> _Progress:
    """The model to train from: the seed, or the last checkpoint every rank holds with a pointer, verified. A host
    killed while its peers saved a checkpoint is one checkpoint behind them, and they retrain to meet it."""
    held = receipts.held(run.directory)
    preflight.check_disk(run.plan, run.directory, set(held.pointed) | set(held.unpointed))
    # Every checkpoint stores the seed's tensors, as the seed does.
    tensor_layout = seedfiles.tensor_layout(run.model_dir)
    common = distributed.minimum(run.world, max(held.pointed, default=0), run.device)
    pointer = held.pointed.get(common) if common else None
    if common and pointer is None:
        raise CoopError(f"{run.directory} has no checkpoint at step {common}, where the other ranks resume")
    journal: list[StepRecord] = []
    problem = None
    if pointer is not None:
        try:
            receipt = receipts.verify(run.directory, pointer, run.binding, tensor_layout)
            _check_journal(receipt.journal, run.batches, f"checkpoint {pointer.checkpoint}")
            journal = list(receipt.journal)
        except CoopError as exc:
            problem = str(exc)
    # A gang refuses together: a rank whose checkpoint fails its checks, and every peer with it.
    if distributed.any_rank(run.world, problem is not None, run.device):
        raise CoopError(problem or f"a peer's checkpoint at step {common} failed its checks; no rank resumes")
    if pointer is None:
        model = seedmodel.load_model(run.model_dir)
    else:
        model = seedmodel.load_model(receipts.model_dir(run.directory, pointer))
    model.to(run.device)
    model.train()
    distributed.agree(run.world, "parameter digest after load", distributed.parameter_digest(model), run.device)
    return _Progress(
        model=model,
        held=held,
        tensor_layout=tensor_layout,
        pointer=pointer,
        journal=journal,
        resumed_from_step=len(journal),
    )


def _update(run: _Run, trainer: Trainer, step: int) -> StepRecord:
    """One update of the schedule, as its journal records it."""
    began, written = _clock(run.device), written_bytes()
    batch = run.batches[step - 1]
    update = trainer.accumulate(batch)
    rate, norm = trainer.step(step)
    after = written_bytes()
    return StepRecord(
        step=step,
        positions=batch,
        local_positions=local_positions(batch, run.world),
        loss=update.loss,
        learning_rate=rate,
        gradient_norm=norm,
        targets=update.targets,
        weighted_targets=update.weighted_targets,
        documents=update.documents,
        seconds=_clock(run.device) - began,
        written_bytes=after - written,
    )


def _checkpoint(run: _Run, progress: _Progress, trainer: Trainer, step: int, emit: Emit) -> None:
    """Save this step's checkpoint, or confirm the one an earlier attempt left here; it becomes the latest."""
    digest = distributed.parameter_digest(progress.model)
    # Each step comes once: a pointer written here is never looked up in ``held``.
    kept = receipts.kept(run.directory, progress.held, step, run.binding, digest, progress.tensor_layout)
    extra = {} if trainer.outer is None else {OUTER: trainer.outer.state_dict()}
    if kept is None:
        layout = progress.tensor_layout
        needed = checkpoint.space_needed(progress.model, trainer.optimizer, run.model_dir, layout, extra)
        problem = checkpoint.no_space(run.directory, step, needed)
    else:
        problem = None
    # Every rank stops together when one has no room: a rank that went on alone would wait for its peers' next
    # collective until the gang's timeout.
    if distributed.any_rank(run.world, problem is not None, run.device):
        raise CoopError(problem or f"a peer rank has no space for the checkpoint of step {step}; no rank writes it")
    if kept is None:
        pointer = checkpoint.save(
            run.directory,
            step,
            progress.model,
            trainer.optimizer,
            run.binding,
            digest,
            progress.journal,
            run.model_dir,
            progress.tensor_layout,
            extra=extra,
        )
        written = "checkpoint"
    else:
        pointer, written = kept
    progress.pointer = pointer
    emit(
        {
            "event": "checkpoint",
            "arm": run.arm,
            "rank": run.world.rank,
            "step": step,
            "checkpoint": pointer.checkpoint,
            "parameter_digest": digest,
            "written": written,
        }
    )


class _LiveSamples:
    """The resource samples a run reports as events while it goes on, each with the update it was taken in, so that
    the coordinator shows them before the run's result arrives. A run that finished before reports its result again
    (``_complete``), with that run's samples: this one's are not reported, so that no event contradicts it."""

    def __init__(self, run: _Run, sampler: Sampler, emit: Emit, finished: Result | None) -> None:
        self._run, self._sampler, self._emit = run, sampler, emit
        self._reported = 0
        self._silent = finished is not None

    def report(self, step: int) -> None:
        if self._silent:
            return
        taken = self._sampler.samples[self._reported :]
        for index, sample in enumerate(taken, start=self._reported):
            where = {"event": "resources", "arm": self._run.arm, "rank": self._run.world.rank, "step": step}
            self._emit(where | {"index": index} | msgspec.to_builtins(sample))
        self._reported += len(taken)


def _updates(
    run: _Run,
    progress: _Progress,
    trainer: Trainer,
    record: RunRecord,
    samples: _LiveSamples,
    emit: Emit,
    stop_after: int | None,
    finished: Result | None,
) -> bool:
    """Every update left, journaled and reported (its journal entry and the resource samples taken during it), with
    a checkpoint where the plan has one. False: ``stop_after`` ended the run early. A run that finished before is
    reported with its own journal entries (a rank retrains the steps its peers lack to the same parameters; only
    the entries' times differ), as its result will be."""
    reported = {} if finished is None else {entry.step: entry for entry in finished.journal}
    deadline = datetime.fromisoformat(record.deadline_at)
    for step in range(progress.resumed_from_step + 1, run.plan.training.updates + 1):
        if datetime.now(UTC) > deadline:
            raise CoopError(f"the run's deadline {record.deadline_at} passed before update {step}")
        entry = _update(run, trainer, step)
        progress.journal.append(entry)
        shown = reported.get(step, entry)
        emit(
            {
                "event": "step",
                "arm": run.arm,
                "rank": run.world.rank,
                "done": step,
                "total": run.plan.training.updates,
                **msgspec.to_builtins(shown),
                **({"outer_steps": trainer.outer_steps(step)} if trainer.outer is not None else {}),
            }
        )
        samples.report(step)
        if step in run.plan.training.checkpoint_steps:
            _checkpoint(run, progress, trainer, step, emit)
        if stop_after is not None and step >= stop_after:
            emit({"event": "stopped", "arm": run.arm, "rank": run.world.rank, "step": step})
            return False
    return True


def _load_outer(run: _Run, pointer: Pointer, outer: OuterState) -> None:
    """The outer momentum of the checkpoint every worker resumes from; every rank refuses if one lacks it."""
    problem = None
    try:
        outer.load_state_dict(checkpoint.load_extra(run.directory, pointer, OUTER))
    except CoopError as exc:
        problem = str(exc)
    if distributed.any_rank(run.world, problem is not None, run.device):
        raise CoopError(problem or f"a peer's checkpoint at step {pointer.step} lacks its outer state; no rank resumes")


def _synchronization(run: _Run, trainer: Trainer) -> Communication:
    """How the ranks met: a DiLoCo arm's outer steps and the bytes it handed their all-reduce in this attempt."""
    if trainer.outer is None:
        return {}
    updates = run.plan.training.updates
    return {
        "synchronization": "diloco",
        "sync_every": trainer.sync_every,
        "outer_steps": trainer.outer_steps(updates),
        "outer_allreduce_bytes": trainer.handed_bytes,
    }


def _result(
    run: _Run,
    progress: _Progress,
    trainer: Trainer,
    final_digest: str,
    loop_seconds: float,
    network_start: NetworkCounters,
    sampler: Sampler,
) -> Result:
    """The run's result: its final checkpoint is its candidate, with the journal and what the run used."""
    pointer = progress.pointer
    assert pointer is not None and pointer.step == run.plan.training.updates  # the plan ends on a checkpoint step
    peak, peak_kind = _peak_memory(run.device, sampler)
    return Result(
        arm=run.arm,
        rank=run.world.rank,
        world_size=run.world.size,
        binding=run.binding,
        prepared_identity=run.prepared.identity,
        numerical_profile=run.profile,
        communication=communication_profile(run.device, run.plan.runtime.backend) | _synchronization(run, trainer),
        parameter_digest=final_digest,
        candidate=pointer,
        journal=progress.journal,
        loop_seconds=loop_seconds,
        resumed_from_step=progress.resumed_from_step,
        network_start=network_start,
        network_end=network_counters(),
        peak_memory_bytes=peak,
        peak_memory_kind=peak_kind,
        resource_samples=sampler.samples,
    )


def _finished_before(run: _Run) -> Result | None:
    """The result of this rank's run, if an earlier attempt finished it."""
    path = run.directory / "result.json"
    return msgspec.convert(read_json(path), type=Result) if path.exists() else None


def _complete(run: _Run, result: Result, emit: Emit) -> None:
    """Write the result file, once, and report the run completed. A run that finished before, whose attempt was lost
    before it reported (its host cut off, say), has resumed from its final checkpoint to the same parameters: its
    result file is reported again, unchanged."""
    path = run.directory / "result.json"
    if path.exists():
        earlier = msgspec.convert(read_json(path), type=Result)
        same = (earlier.binding, earlier.parameter_digest, earlier.candidate)
        if same != (result.binding, result.parameter_digest, result.candidate):
            raise CoopError(f"{path} holds a finished run that this one does not reproduce; it is never overwritten")
        result = earlier
    else:
        write_new_json(path, msgspec.to_builtins(result))
    completed = CompletedEvent(
        arm=run.arm,
        rank=run.world.rank,
        parameter_digest=result.parameter_digest,
        loop_seconds=round(result.loop_seconds, 3),
        result=str(path),
    )
    emit(msgspec.to_builtins(completed))


def train(home: Path, model_dir: Path, arm: str, emit: Emit, stop_after: int | None = None) -> Result | None:
    """Train one rank of ``arm``, resuming from its latest verified checkpoint if it has one.

    ``stop_after`` ends the run after that update (tests use it to interrupt a run); it returns None then."""
    run = _bind_run(home, model_dir, arm)
    try:
        return _train(run, arm, emit, stop_after)
    except Exception as exc:
        if run.world.distributed and distributed.is_link_failure(exc):
            raise LinkError(
                f"rank {run.world.rank} of {arm}: the gang's communication broke ({str(exc)[:500]}); "
                "a retry resumes from the last checkpoint every rank holds"
            ) from exc
        raise


def _train(run: _Run, arm: str, emit: Emit, stop_after: int | None) -> Result | None:
    # The trainer closes before the process group ends (the ExitStack exits first).
    with _process_group(run.world, run.plan), contextlib.ExitStack() as closing:
        record = _start(run)
        progress = _resume(run)
        trainer = closing.enter_context(
            Trainer(run.plan, run.world, run.device, progress.model, run.documents, arm=run.plan.arm_plan(arm))
        )
        if progress.pointer is not None:
            checkpoint.load_state(run.directory, progress.pointer, trainer.optimizer, run.device)
            if trainer.outer is not None:
                _load_outer(run, progress.pointer, trainer.outer)
        emit(
            {
                "event": "started",
                "arm": arm,
                "rank": run.world.rank,
                "world_size": run.world.size,
                "binding": run.binding,
                "numerical_profile": run.profile,
                "resumed_from_step": progress.resumed_from_step,
                "updates": run.plan.training.updates,
            }
        )
        network_start = network_counters()
        with _sampler(run) as sampler:
            loop_start = _clock(run.device)
            finished = _finished_before(run)
            samples = _LiveSamples(run, sampler, emit, finished)
            if not _updates(run, progress, trainer, record, samples, emit, stop_after, finished):
                return None
            final_digest = distributed.parameter_digest(progress.model)
            distributed.agree(run.world, "final parameter digest", final_digest, run.device)
            loop_seconds = _clock(run.device) - loop_start
        samples.report(run.plan.training.updates)  # the last, taken as the sampler stopped
        result = _result(run, progress, trainer, final_digest, loop_seconds, network_start, sampler)
        _complete(run, result, emit)
        return result
