"""The canary: every step of a run that only the real hosts can fail, tried on them in minutes before the plan is
committed (docs/operating.md, "The canary"). ``coop canary`` runs on each host of the gang at once, as one rank,
with the plan's seed and runtime and the production code of each step:

1. ``prepare``: the plan's prepared inputs, built here as ``coop prepare`` builds them;
2. ``all-reduce``: the gang meets over its link, agrees on the prepared identity and on its numerical profile's
   shared fields (the libraries' versions, the device, the numerics), and all-reduces a float32 tensor of the
   gradient's size; the bus bandwidth must let the plan's updates reduce within a quarter of its deadline;
3. ``ddp-update``: the preflight's memory check, then one update of the seed under the production DDP wrapper
   (updates.Trainer) with the schedule's first batch; every rank holds the same parameters after it, and on a GPU
   the peak stays within what the preflight reserves;
4. ``checkpoint``: a full-state save (weights and AdamW's moments), then the resume's load into a fresh model,
   optimizer and DDP wrapper, the weights read back bit for bit, with the host's peak RSS against its memory;
5. ``evaluate``: the seed's greedy answers to the first dev tasks in the plan's numerics, as ``coop evaluate``;
6. ``replica``: a vLLM replica of the seed started with the production flags, whose answers to the same tasks
   must pass the probe's identity check against that evaluation (agreement.refusal, which names each task);
7. ``replica-stop``: the replica stops on SIGTERM within the grace.

A step that fails records why and what fixes it, and the canary ends there: later steps build on it. A rank whose
peer failed a step the gang shares ends at that step too, saying so. The command exits 0 with a verdict either
way; the coordinator refuses to commit a GPU plan whose canary did not pass on every host, unless an operator
overrides it (server/protocol/canaries.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import resource
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import httpx
import msgspec
import psutil
import torch
import torch.distributed as dist

from experiment.core.canonical import JsonLike
from experiment.core.errors import CoopError
from experiment.core.plan import Plan, load_plan, seed_identity
from experiment.core.ports import free_port
from experiment.core.progress import Emit
from experiment.learning import corpus, distributed, preflight, training, updates
from experiment.learning.checkpoint import load_state, save
from experiment.learning.corpus import Prepared, load_prepared
from experiment.learning.decoding import generate
from experiment.learning.evaluation import answering_model, answers_of, batch_size_for
from experiment.learning.events import CanariedEvent, CanaryStep, Figure
from experiment.learning.profile import check_shared, numerical_profile
from experiment.learning.receipts import model_dir as checkpoint_model_dir
from experiment.learning.records import Answer
from experiment.learning.schedule import schedule
from experiment.seed import seedfiles, seedmodel
from experiment.seed.seedtokenizer import read_tokenizer
from experiment.serving import agreement, replica
from experiment.serving.probe import ProbeService

ALLREDUCE_DEADLINE_SHARE = 0.25  # the gang's all-reduces may take at most this share of the plan's deadline
ALLREDUCE_REPEATS = 3
COLLECTIVE_SECONDS = 600.0  # a canary's collectives wait at most this long for a peer
REPLICA_STARTUP_SECONDS = 900.0
REPLICA_GRACE_SECONDS = 30.0
HOST_MEMORY_SHARE = 0.9  # a full-state save may peak at most at this share of the host's memory
GIB = 2**30

FIXES: dict[str, str] = {
    "prepare": "stage the plan's seed and reference home on this host as the runbook's step 3 says, and record "
    "their hashes in the plan (coop seed-model snapshot, coop reference-home snapshot)",
    "all-reduce": "check the private link: both agents' --private-interface and --private-address, a security "
    "group that lets all TCP through between the hosts' private addresses, and one placement group for both "
    "instances; a link slower than the plan needs misses its deadline",
    "ddp-update": "run coop-agent doctor: out of GPU memory means another process holds the GPU (nvidia-smi) or "
    "the card is smaller than the plan needs (docs/protocol.md, GPU memory); a CUDA error, a driver older than "
    "the CUDA wheels need",
    "checkpoint": "put the agent's work folder on the instance's NVMe (--work-dir, docs/operating.md) with room "
    "for the plan's checkpoints, and keep other processes off the host's memory",
    "evaluate": "run coop-agent doctor: the seed's files and the host's torch must load and decode on the device",
    "replica": "run coop-agent doctor (the serving venv must hold the official CUDA vllm); a refused identity "
    "check names each differing task: the replica reads the seed or its numerics otherwise than transformers",
    "replica-stop": "read the replica's log in the canary's folder: a replica that ignores SIGTERM would hold its "
    "GPU through the failure phase",
}


class StepFailed(CoopError):
    """A step that ran and measured what fails it (a slow link, a peak over the preflight)."""

    def __init__(self, reason: str, figures: dict[str, Figure]) -> None:
        super().__init__(reason)
        self.figures = figures


class Canary:
    """The steps run so far on this host, each emitted as it ends."""

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.steps: list[CanaryStep] = []

    @property
    def passed(self) -> bool:
        return all(step.passed for step in self.steps)

    def run(self, name: str, action: Callable[[], dict[str, Figure]]) -> bool:
        """Run a step, record it, and say whether it passed. Any exception fails the step (an out-of-memory error
        is what a canary is for), with the step's fix."""
        self.emit({"event": "canary-step-started", "step": name})
        began = time.monotonic()
        figures: dict[str, Figure] = {}
        failure: str | None = None
        try:
            figures = action()
        except StepFailed as exc:
            figures, failure = exc.figures, str(exc)
        except CoopError as exc:
            failure = str(exc)[:3000]
        except Exception as exc:  # every failure is its step's, and the canary goes no further
            failure = f"{type(exc).__name__}: {exc}"[:3000]
        step = CanaryStep(
            name=name,
            passed=failure is None,
            seconds=round(time.monotonic() - began, 3),
            figures=figures,
            failure=failure,
            fix=None if failure is None else FIXES[name],
        )
        self.steps.append(step)
        self.emit({"event": "canary-step", **msgspec.to_builtins(step)})
        return step.passed


def needed_bandwidth(plan: Plan, world_size: int) -> float:
    """Bytes a second of bus bandwidth the gang's all-reduces need: one float32 gradient per update, each moving
    2(n-1)/n of its bytes, within ALLREDUCE_DEADLINE_SHARE of the plan's deadline."""
    moved = plan.training.updates * plan.seed.parameters * 4 * 2 * (world_size - 1) / world_size
    return moved / (ALLREDUCE_DEADLINE_SHARE * plan.training.deadline_hours * 3600)


def _host_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _gpu_peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


class _Steps:
    """What the steps share on this host: the plan, the rank, the prepared inputs and the model between steps."""

    def __init__(self, plan: Plan, plan_path: Path, home: Path, model_dir: Path, reference_home: Path | None) -> None:
        self.plan, self.plan_path, self.home = plan, plan_path, home
        self.model_dir, self.reference_home = model_dir, reference_home
        self.world = distributed.world_from_env()
        self.arm = plan.largest_gang()
        self.device = torch.device("cpu")
        self.prepared: Prepared | None = None
        self.trainer: updates.Trainer | None = None
        self.answers: list[Answer] = []
        self.replica: replica.Replica | None = None
        self.log: IO[Any] | None = None
        self.grouped = False

    # 1 ------------------------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Figure]:
        manifest = corpus.prepare(self.plan, self.plan_path, self.home, self.model_dir, self.reference_home, _quiet)
        self.prepared = load_prepared(self.home)
        return {"prepared_identity": corpus.prepared_identity(manifest), "dev_tasks": len(manifest.ids["dev"])}

    # 2 ------------------------------------------------------------------------------------------------------
    def all_reduce(self) -> dict[str, Figure]:
        assert self.prepared is not None
        figures: dict[str, Figure] = {"world_size": self.world.size, "backend": self.plan.runtime.backend}
        if not self.world.distributed:
            return figures | {"note": "a world of one reduces nothing"}
        distributed.agree(self.world, "prepared inputs", self.prepared.identity, self.device)
        # The fields every rank of a training gang must share (libraries, device, numerics): a host installed
        # otherwise is named now, not at the pair's first update.
        check_shared(self.world, numerical_profile(self.plan, self.device), self.device)
        tensor = torch.ones(self.plan.seed.parameters, dtype=torch.float32, device=self.device)
        dist.all_reduce(tensor)  # warm-up: the communicator's connections
        seconds = []
        for _ in range(ALLREDUCE_REPEATS):
            tensor.fill_(1.0)
            _synchronize(self.device)
            began = time.monotonic()
            dist.all_reduce(tensor)
            _synchronize(self.device)
            seconds.append(time.monotonic() - began)
        exact = bool(torch.all(tensor == float(self.world.size)))
        del tensor
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the preflight that follows reads the free memory, cached blocks excluded
        n = self.world.size
        bus = self.plan.seed.parameters * 4 * 2 * (n - 1) / n / min(seconds)
        needed = needed_bandwidth(self.plan, n)
        figures |= {
            "bytes": self.plan.seed.parameters * 4,
            "best_seconds": round(min(seconds), 4),
            "bus_bytes_per_second": round(bus),
            "needed_bytes_per_second": round(needed),
            "sum_exact": exact,
        }
        if not exact:
            raise StepFailed(f"the all-reduce's sum is not {n} everywhere: the link corrupts data", figures)
        if bus < needed:
            raise StepFailed(
                f"the link reduces {bus / 1e6:.0f} MB/s; the plan's {self.plan.training.updates} updates need "
                f"{needed / 1e6:.0f} MB/s to reduce within {ALLREDUCE_DEADLINE_SHARE:.0%} of its "
                f"{self.plan.training.deadline_hours:g} h deadline",
                figures,
            )
        return figures

    # 3 ------------------------------------------------------------------------------------------------------
    def ddp_update(self) -> dict[str, Figure]:
        assert self.prepared is not None
        preflight.check_memory(self.plan, self.world.size, self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        model = seedmodel.load_model(self.model_dir)
        model.to(self.device)
        model.train()
        documents = training.documents_for(self.prepared, self.arm)
        self.trainer = updates.Trainer(self.plan, self.world, self.device, model, documents)
        batch = schedule(self.plan)[0]
        update = self.trainer.accumulate(batch)
        rate, norm = self.trainer.step(1)
        digest = distributed.parameter_digest(model)
        distributed.agree(self.world, "parameters after one update", digest, self.device)
        needed = preflight.memory_needed(self.plan, self.world.size)
        peak = _gpu_peak(self.device)
        figures: dict[str, Figure] = {
            "documents": len(batch),
            "longest_document_tokens": max(len(documents[p].input_ids) for p in batch),
            "loss": round(update.loss, 6),
            "gradient_norm": round(norm, 6),
            "learning_rate": rate,
            "ddp": self.world.distributed,
            "parameter_digest": digest,
            "preflight_bytes": needed,
        }
        if peak is None:
            return figures | {"host_peak_rss_bytes": _host_peak_rss()}
        figures["gpu_peak_bytes"] = peak
        if peak > needed:
            raise StepFailed(
                f"one update peaked at {peak / GIB:.2f} GiB of GPU memory; the preflight reserves {needed / GIB:.2f}",
                figures,
            )
        return figures

    # 4 ------------------------------------------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Figure]:
        """Save the full state, then resume from it as `coop train` does after a stop: the weights from the
        checkpoint's model folder, a new optimizer (and DDP wrapper) on them, and AdamW's moments loaded into it."""
        assert self.trainer is not None and self.prepared is not None
        run_dir = self.home / "canary-checkpoint"
        shutil.rmtree(run_dir, ignore_errors=True)  # a retried attempt's
        digest = distributed.parameter_digest(self.trainer.model)
        layout = seedfiles.tensor_layout(self.model_dir)
        rss_before = _host_peak_rss()
        began = time.monotonic()
        pointer = save(
            run_dir, 1, self.trainer.model, self.trainer.optimizer, "canary", digest, [], self.model_dir, layout
        )
        saved = time.monotonic() - began
        written = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
        rss_saved = _host_peak_rss()
        self._free_trainer()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        began = time.monotonic()
        model = seedmodel.load_model(checkpoint_model_dir(run_dir, pointer))
        read_back = distributed.parameter_digest(model)
        model.to(self.device)
        documents = training.documents_for(self.prepared, self.arm)
        self.trainer = updates.Trainer(self.plan, self.world, self.device, model, documents)
        load_state(run_dir, pointer, self.trainer.optimizer, self.device)
        load_seconds = time.monotonic() - began
        shutil.rmtree(run_dir)  # the checkpoint's bytes are the plan's to use
        memory = psutil.virtual_memory().total
        peak = _host_peak_rss()
        figures: dict[str, Figure] = {
            "bytes_written": written,
            "save_seconds": round(saved, 3),
            "load_seconds": round(load_seconds, 3),
            "host_peak_rss_before_bytes": rss_before,
            "host_peak_rss_after_save_bytes": rss_saved,
            "host_peak_rss_bytes": peak,
            "host_memory_bytes": memory,
        }
        gpu = _gpu_peak(self.device)
        if gpu is not None:
            figures["resume_gpu_peak_bytes"] = gpu
        if read_back != digest:
            raise StepFailed("the checkpoint's weights read back differ from the weights saved", figures)
        if peak > HOST_MEMORY_SHARE * memory:
            raise StepFailed(
                f"the save and load peaked at {peak / GIB:.1f} GiB of this host's {memory / GIB:.1f} GiB", figures
            )
        return figures

    def _free_trainer(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def end_training(self) -> None:
        """Free the training's memory and the process group: the evaluation and the replica need the device."""
        self._free_trainer()
        if self.grouped:
            distributed.stop(self.world)
            self.grouped = False

    # 5 ------------------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Figure]:
        assert self.prepared is not None
        device = self.plan.runtime.device
        items = self.prepared.task_items("dev")[: agreement.identity_tasks(device)]
        tokenizer = read_tokenizer(self.model_dir)
        model = answering_model(seedmodel.load_model(self.model_dir), device, self.plan.evaluation.numerics)
        began = time.monotonic()
        prompts = [item.prompt_ids for item in items]
        batch = batch_size_for(device)
        generations = generate(
            model, prompts, tokenizer.eos_id, tokenizer.pad_id, self.plan.evaluation.max_new_tokens, batch
        )
        seconds = time.monotonic() - began
        self.answers = answers_of(items, generations, tokenizer, seconds)
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        return {
            "tasks": len(items),
            "batch_size": batch,
            "numerics": self.plan.evaluation.numerics,
            "correct": sum(a.check.correct for a in self.answers),
            "answer_seconds": round(seconds, 3),
        }

    # 6 ------------------------------------------------------------------------------------------------------
    def serve(self) -> dict[str, Figure]:
        assert self.prepared is not None
        plan, host = self.plan, "127.0.0.1"
        spec = replica.ReplicaSpec(
            model_dir=self.model_dir,
            served_model_name=seed_identity(plan),
            port=free_port(host),
            host=host,
            device=plan.runtime.device,
            python=replica.vllm_python(),
            dtype=plan.evaluation.numerics,
        )
        self.log = (self.home.parent / "canary-replica.log").open("ab")
        self.replica = replica.Replica(spec, self.log)
        self.replica.start()
        healthy = self.replica.wait_healthy(REPLICA_STARTUP_SECONDS)
        service = ProbeService(
            items=self.prepared.task_items("dev"),
            tokenizer=read_tokenizer(self.model_dir),
            replica=spec.url,
            max_new_tokens=plan.serving.max_new_tokens,
            cache_size=plan.serving.retry_cache_size,
            client=httpx.AsyncClient(),
        )

        async def check() -> agreement.Agreement:
            try:
                return await service.check_answers(spec.served_model_name, self.answers, plan.runtime.device)
            finally:
                await service.client.aclose()

        found = asyncio.run(check())
        return {
            "healthy_seconds": round(healthy, 3),
            "device": plan.runtime.device,
            "gpu_memory_utilization": spec.gpu_memory_utilization if spec.device == "cuda" else 0.0,
            "tasks": found.tasks,
            "identical": found.identical,
            "same_outcome": found.same_outcome,
            "allowed_differences": agreement.allowed_differences(found.tasks, plan.runtime.device),
            "token_agreement": round(found.token_agreement, 6),
        }

    # 7 ------------------------------------------------------------------------------------------------------
    def stop_replica(self) -> dict[str, Figure]:
        assert self.replica is not None
        began = time.monotonic()
        code = self.replica.stop(REPLICA_GRACE_SECONDS)
        seconds = time.monotonic() - began
        self.replica = None
        figures: dict[str, Figure] = {"exit_code": code, "stop_seconds": round(seconds, 3)}
        if seconds >= REPLICA_GRACE_SECONDS:
            raise StepFailed(f"the replica did not stop within the {REPLICA_GRACE_SECONDS:.0f} s grace", figures)
        return figures

    def close(self) -> None:
        """Whatever ended the canary: no replica, process group or open log outlives it."""
        if self.replica is not None:
            with contextlib.suppress(CoopError, OSError):
                self.replica.stop(REPLICA_GRACE_SECONDS)
        if self.log is not None:
            self.log.close()
        self.end_training()

    def shared(self, canary: Canary, name: str, action: Callable[[], dict[str, Figure]]) -> bool:
        """A step of the whole gang: it passes on this rank only if it passed on every rank."""
        mine = canary.run(name, action)
        if not self.grouped:
            return mine
        peers_failed = self.any_rank_failed(not mine)
        if mine and peers_failed:
            last = canary.steps[-1]
            canary.steps[-1] = msgspec.structs.replace(
                last, passed=False, failure=f"a peer failed its {name} step (its own record says why)", fix=FIXES[name]
            )
        return mine and not peers_failed

    def any_rank_failed(self, failed: bool) -> bool:
        """Whether some rank failed; a link that breaks while the ranks compare counts as a failure."""
        try:
            return distributed.any_rank(self.world, failed, self.device)
        except Exception:  # the gang's link: the step that used it records what broke
            return True

    def run_all(self, canary: Canary) -> None:
        if not canary.run("prepare", self.prepare) and not self.world.distributed:
            return
        try:
            self.device = updates.configure_runtime(self.plan, self.world)
            distributed.start(
                self.world,
                self.plan.runtime.backend,
                timeout_seconds=min(COLLECTIVE_SECONDS, self.plan.runtime.collective_timeout_seconds),
            )
        except Exception as exc:  # the device or the rendezvous: the first step on the gang's link fails
            canary.run("all-reduce", _failed(f"the gang did not meet: {type(exc).__name__}: {exc}"))
            return
        self.grouped = self.world.distributed
        if self.grouped and self.any_rank_failed(not canary.passed):
            if canary.passed:
                canary.run("all-reduce", _failed("a peer failed its prepare step (its own record says why)"))
            return
        for name, action in (
            ("all-reduce", self.all_reduce),
            ("ddp-update", self.ddp_update),
            ("checkpoint", self.checkpoint),
        ):
            if not self.shared(canary, name, action):
                return
        self.end_training()
        if canary.run("evaluate", self.evaluate) and canary.run("replica", self.serve):
            canary.run("replica-stop", self.stop_replica)


def _failed(reason: str) -> Callable[[], dict[str, Figure]]:
    def action() -> dict[str, Figure]:
        raise CoopError(reason)

    return action


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _quiet(event: Mapping[str, JsonLike]) -> None:
    """Prepare's own progress: the canary reports its steps instead."""


def run(plan_path: Path, home: Path, model_dir: Path, reference_home: Path | None, emit: Emit) -> CanariedEvent:
    """``coop canary``: every step on this host, as rank RANK of WORLD_SIZE (torchrun's variables), then the
    verdict as a ``canaried`` event."""
    plan = load_plan(plan_path)
    canary = Canary(emit)
    steps = _Steps(plan, plan_path, home, model_dir, reference_home)
    try:
        steps.run_all(canary)
    finally:
        steps.close()
    event = CanariedEvent(rank=steps.world.rank, world_size=steps.world.size, passed=canary.passed, steps=canary.steps)
    emit(msgspec.to_builtins(event))
    return event
