"""A rank's training run of an arm, top to bottom: ``train`` binds the run (inputs, device, schedule, binding),
starts the process group, resumes from the last checkpoint every rank holds, runs the updates left (journaled,
reported, checkpointed on every rank where the plan has a checkpoint) and writes the run's result. The update itself
is experiment.learning.updates' Trainer."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import torch

from experiment.core import layout
from experiment.core.canonical import identity, read_json, write_new_json
from experiment.core.errors import CoopError, LinkError
from experiment.core.plan import Plan
from experiment.core.progress import Emit
from experiment.learning import checkpoint, distributed, preflight, receipts
from experiment.learning.corpus import Document, Prepared, load_prepared, seed_snapshot
from experiment.learning.diloco import OuterState
from experiment.learning.distributed import World
from experiment.learning.events import (
    CheckpointEvent,
    CompletedEvent,
    ResourcesEvent,
    StartedEvent,
    StepEvent,
    StoppedEvent,
)
from experiment.learning.profile import check_shared, numerical_profile, shared
from experiment.learning.records import Communication, NetworkCounters, NumericalProfile, Pointer, Result, StepRecord
from experiment.learning.resources import Sampler, network_counters, written_bytes
from experiment.learning.schedule import schedule
from experiment.learning.updates import Trainer, communication_profile, configure_runtime, local_positions
from experiment.seed import seedfiles, seedmodel

# A DiLoCo checkpoint's outer state (experiment.learning.diloco), beside the inner optimizer's.
OUTER = "outer.pt"


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
        started = StartedEvent(
            arm=arm,
            rank=run.world.rank,
            world_size=run.world.size,
            binding=run.binding,
            numerical_profile=run.profile,
            resumed_from_step=progress.resumed_from_step,
            updates=run.plan.training.updates,
        )
        emit(msgspec.to_builtins(started))
        network_start = network_counters()
        with _sampler(run) as sampler:
            loop_start = _clock(run.device)
            finished = _finished_before(run)
            loop = _Loop(run, progress, trainer, record, _LiveSamples(run, sampler, emit, finished), emit, finished)
            if not loop.updates(stop_after):
                return None
            final_digest = distributed.parameter_digest(progress.model)
            distributed.agree(run.world, "final parameter digest", final_digest, run.device)
            loop_seconds = _clock(run.device) - loop_start
        loop.samples.report(run.plan.training.updates)  # the last, taken as the sampler stopped
        result = _result(run, progress, trainer, final_digest, loop_seconds, network_start, sampler)
        _complete(run, result, emit)
        return result


@dataclass
class _Loop:
    """The updates a resumed rank has left, and what they read and change: the run, where it stands, its trainer,
    its record (the deadline), its live resource samples and, for a rank whose run finished before, that result."""

    run: _Run
    progress: _Progress
    trainer: Trainer
    record: RunRecord
    samples: _LiveSamples
    emit: Emit
    finished: Result | None

    def updates(self, stop_after: int | None) -> bool:
        """Every update left, journaled and reported (its journal entry and the resource samples taken during it),
        with a checkpoint where the plan has one. False: ``stop_after`` ended the run early. A run that finished
        before is reported with its own journal entries (a rank retrains the steps its peers lack to the same
        parameters; only the entries' times differ), as its result will be."""
        run, trainer = self.run, self.trainer
        reported = {} if self.finished is None else {entry.step: entry for entry in self.finished.journal}
        deadline = datetime.fromisoformat(self.record.deadline_at)
        for step in range(self.progress.resumed_from_step + 1, run.plan.training.updates + 1):
            if datetime.now(UTC) > deadline:
                raise CoopError(f"the run's deadline {self.record.deadline_at} passed before update {step}")
            entry = _update(run, trainer, step)
            self.progress.journal.append(entry)
            shown = reported.get(step, entry)
            reported_step = StepEvent(
                **msgspec.structs.asdict(shown),
                arm=run.arm,
                rank=run.world.rank,
                done=step,
                total=run.plan.training.updates,
                outer_steps=trainer.outer_steps(step) if trainer.outer is not None else None,
            )
            self.emit(msgspec.to_builtins(reported_step))
            self.samples.report(step)
            if step in run.plan.training.checkpoint_steps:
                self.checkpoint(step)
            if stop_after is not None and step >= stop_after:
                self.emit(msgspec.to_builtins(StoppedEvent(arm=run.arm, rank=run.world.rank, step=step)))
                return False
        return True

    def checkpoint(self, step: int) -> None:
        """Save this step's checkpoint, or confirm the one an earlier attempt left here; it becomes the latest."""
        run, progress, trainer = self.run, self.progress, self.trainer
        digest = distributed.parameter_digest(progress.model)
        # Each step comes once: a pointer written here is never looked up in ``held``.
        kept = receipts.kept(run.directory, progress.held, step, run.binding, digest, progress.tensor_layout)
        extra = {} if trainer.outer is None else {OUTER: trainer.outer.state_dict()}
        if kept is None:
            needed = checkpoint.space_needed(
                progress.model, trainer.optimizer, run.model_dir, progress.tensor_layout, extra
            )
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
        saved = CheckpointEvent(
            arm=run.arm,
            rank=run.world.rank,
            step=step,
            checkpoint=pointer.checkpoint,
            parameter_digest=digest,
            written=written,
        )
        self.emit(msgspec.to_builtins(saved))


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
        run = self._run
        for index, sample in enumerate(taken, start=self._reported):
            fields = msgspec.structs.asdict(sample)
            event = ResourcesEvent(**fields, arm=run.arm, rank=run.world.rank, step=step, index=index)
            self._emit(msgspec.to_builtins(event))
        self._reported += len(taken)


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


def _check_journal(journal: list[StepRecord], batches: list[list[int]], source: str) -> None:
    for number, record in enumerate(journal, start=1):
        if record.step != number or record.positions != batches[number - 1]:
            raise CoopError(f"{source}: journal entry {number} is not the schedule's update {number}")


def _load_outer(run: _Run, pointer: Pointer, outer: OuterState) -> None:
    """The outer momentum of the checkpoint every worker resumes from; every rank refuses if one lacks it."""
    problem = None
    try:
        outer.load_state_dict(checkpoint.load_extra(run.directory, pointer, OUTER))
    except CoopError as exc:
        problem = str(exc)
    if distributed.any_rank(run.world, problem is not None, run.device):
        raise CoopError(problem or f"a peer's checkpoint at step {pointer.step} lacks its outer state; no rank resumes")


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


def _clock(device: torch.device) -> float:
    """The time once the device has done what was queued on it (CUDA runs the optimizer's step asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic()
