"""The one prepared GPU check: the CUDA path of a reference run, on a random Llama shaped like SmolLM2-1.7B.

Run by ``bench/gpu-check.sh`` on a lent GPU machine (nothing downloaded). Each step is one question the CPU tests
cannot answer, and its answer is a figure or a pass/fail in the JSON it prints. Beside each measured GPU peak stands
experiment.learning.memory's prediction for it. The seconds each step takes on one H100 or H200, measured (m, on an
H200 with torch 2.11) or estimated (e), about 6 minutes in all after the machine starts, within a 15-minute budget:

1. versions: torch, CUDA, NCCL and the GPU, and the CUDA context's size (0 s);
2. a cuBLAS matmul passes in the project's deterministic mode (and whether deterministic mode without
   ``CUBLAS_WORKSPACE_CONFIG`` refuses it, as a fact of this torch and CUDA): two fresh processes (e 30 s);
3. the model's parameter count is the reference seed's (e 2 s);
4. the real training step (``Trainer`` on the reference plan, world of one) for 3 updates of 8 documents of 1,024
   tokens: seconds per update, peak memory (allocated and reserved) against the preflight rule and the model, and a
   replay's parameters bit-identical (m 34 s);
5. the same step under DDP with a process group of one, so that ``no_sync`` and the buckets run: peak memory
   against the rule for a rank of a pair (a torch older than the project's pin, which lacks DDP's
   ``forward_sync_buffers``, wraps with ``broadcast_buffers=False``, the same forward pass) (m 18 s);
6. the production wrapper itself (``updates.wrap_ddp``, no fallback) in a group of one, on documents of varying
   lengths up to the longest, as the plan's 128 updates are: its peak against the model, what the allocator reserves
   beyond it, and its parameters against the plain Trainer's on the same documents (a group of one reduces nothing)
   (e 40 s);
7. where the peak falls: one document of each length, forward and backward, then AdamW's step, each phase's peak
   above the memory held before it (m 5 s);
8. a full-state checkpoint at the seed's shape: save (``checkpoint.save``), verify, and load as a resume does
   (``seedmodel.load_model``, a fresh Trainer, ``checkpoint.load_state``): seconds, the host's resident set before
   and at its peak during each, the GPU's peak, the stored tensor names the seed's and the loaded parameters the
   saved ones (e 120 s for 20.5 GB, most of it the disk);
9. batched greedy decoding at the evaluation's batch size for the plan's device against one prompt at a time, in
   the plan's numerics: token agreement, no NaN row, the GPU's peak (e 90 s, most of it one prompt at a time).

The card is capped at an L40S's memory. ``--dry-run`` runs the same steps on a CPU with a small model of the
same family (the full shape is only counted, on the meta device), so that the script itself is tested here; the
CUDA-only step (2) says it was skipped, and no GPU figure is measured. Progress goes to stderr as JSON lines; the
result is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from experiment.core import determinism  # noqa: E402
from experiment.core.plan import Plan, load_plan  # noqa: E402
from experiment.learning import (  # noqa: E402
    checkpoint,
    decoding,
    distributed,
    evaluation,
    memory,
    preflight,
    receipts,
    updates,
)
from experiment.learning.corpus import Document  # noqa: E402
from experiment.seed import llama, seedmodel  # noqa: E402
from experiment.seed.shape import Shape  # noqa: E402
from experiment.serving.replica import ReplicaSpec  # noqa: E402

REFERENCE_PLAN = ROOT / "plans" / "reference.toml"
TINY_SEED = ROOT / "seeds" / "tiny"
L40S_MEMORY_BYTES = memory.L40S_BYTES
# SmolLM2-1.7B-Instruct's config.json, the fields that decide its shape and arithmetic.
SMOLLM2_1_7B = asdict(memory.SMOLLM2_1_7B) | {
    "rope_theta": 130_000.0,
    "max_position_embeddings": 8_192,
    "rms_norm_eps": 1e-5,
}
# The same family, small enough for a CPU: what --dry-run trains, saves and evaluates.
DRY_RUN_SHAPE = SMOLLM2_1_7B | {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
UPDATES = 3
PROFILE_TOKENS = (256, 1024)  # the document lengths of step 7 (at most the plan's longest)
EVAL_PROMPTS = 32
Value = TypeVar("Value")


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), file=sys.stderr, flush=True)


def llama_parameters(shape: dict[str, Any]) -> int:
    """The parameter count of a Llama, from its shape alone (no model is built)."""
    return Shape.of(shape).parameters


def config_json(shape: dict[str, Any]) -> dict[str, Any]:
    """A Llama config.json of a shape, as a seed folder holds it."""
    return shape | {"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def config(shape: dict[str, Any]) -> llama.Config:
    """The production model's config of a shape (experiment.seed.llama, the model coop trains and evaluates)."""
    return llama.Config.of(config_json(shape))


def build(shape: dict[str, Any], device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised model, the same one for the same seed (the replay's start)."""
    torch.manual_seed(seed)
    model = llama.Llama(config(shape), device)
    with torch.no_grad():  # transformers' initialisation: normal(0, 0.02), the norms' weights 1
        for name, parameter in model.named_parameters():
            parameter.fill_(1.0) if name.endswith("norm.weight") else parameter.normal_(0.0, 0.02)
    return model.to(device)  # the rotary embedding's frequencies too


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic()


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def peak_reserved(device: torch.device) -> int | None:
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def outside_allocator(device: torch.device) -> int | None:
    """What this process holds on the card beyond torch's allocator (its CUDA context, NCCL's buffers), where it is
    alone on the card."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def _status_bytes(status: str, field: str) -> int:
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(f"{field}:"))) * 1024


def rss_during(action: Callable[[], Value]) -> tuple[Value, dict[str, int]]:
    """``action``'s value, and this process's resident set before it and at its peak during it; and, after it, its
    anonymous and file-backed parts (pages mapped from a file, as the loader maps a safetensors file's weights, are
    the kernel's to drop under pressure). The peak is the kernel's high-water mark (VmHWM), reset to the resident set
    before ``action`` (Linux's /proc/self/clear_refs): a sampling thread would miss a copy made while the GIL is held,
    and ru_maxrss keeps the peak of the process a subprocess was forked from."""
    before = psutil.Process().memory_info().rss
    Path("/proc/self/clear_refs").write_text("5")
    value = action()
    status = Path("/proc/self/status").read_text()
    peak = _status_bytes(status, "VmHWM")
    return value, {
        "rss_before_bytes": before,
        "peak_rss_bytes": peak,
        "peak_above_before_bytes": peak - before,
        "anonymous_after_bytes": _status_bytes(status, "RssAnon"),
        "file_backed_after_bytes": _status_bytes(status, "RssFile"),
    }


def predicted_peak(shape: dict[str, Any], lengths: list[int], ddp: bool) -> int:
    """The memory model's allocator peak for a later update of documents of these lengths (8 a batch)."""
    return memory.update(llama_parameters(shape), lengths, ddp=ddp, first=False).peak


# 1 ------------------------------------------------------------------------------------------------------------


def versions(device: torch.device) -> dict[str, Any]:
    import safetensors
    import transformers

    found: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "device": device.type,
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        found |= {
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),  # type: ignore[no-untyped-call]
            "gpu": properties.name,
            "capability": f"{properties.major}.{properties.minor}",
            "gpu_memory_bytes": properties.total_memory,
            "cuda_context_bytes": outside_allocator(device),
            "predicted_cuda_context_bytes": memory.CUDA_CONTEXT_BYTES,
        }
    return found


# 2 ------------------------------------------------------------------------------------------------------------

_MATMUL = (
    "import sys, torch; sys.path.insert(0, {root!r});\n"
    "from experiment.core import determinism\n"
    "{setup}\n"
    "a = torch.randn(256, 256, device='cuda'); torch.cuda.synchronize(); print(float((a @ a).sum()))\n"
)


def deterministic_mode(device: torch.device) -> dict[str, Any]:
    """A fresh process each way: cuBLAS reads the variable when the process makes its first handle."""
    if device.type != "cuda":
        return {"skipped": "needs a CUDA device"}
    bare = {k: v for k, v in os.environ.items() if k != determinism.VARIABLE}
    outcomes: dict[str, Any] = {}
    for name, setup in (
        ("without_workspace", "torch.use_deterministic_algorithms(True)"),
        ("with_project_setting", "determinism.make_deterministic('cuda', 1)"),
    ):
        code = _MATMUL.format(root=str(ROOT), setup=setup)
        done = subprocess.run([sys.executable, "-c", code], env=bare, capture_output=True, text=True, timeout=120)
        outcomes[name] = {"exit": done.returncode, "last_words": (done.stderr.strip().splitlines() or [""])[-1][:300]}
    outcomes["bare_mode_refused_the_matmul"] = outcomes["without_workspace"]["exit"] != 0
    outcomes["ok"] = outcomes["with_project_setting"]["exit"] == 0
    return outcomes


# 3 ------------------------------------------------------------------------------------------------------------


def shape_check(shape: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The reference shape counted on the meta device (no memory), against the plan and the shape's own formula."""
    with torch.device("meta"):
        model = llama.Llama(config(SMOLLM2_1_7B))
    counted = sum(p.numel() for p in model.parameters())  # a tied tensor is one parameter
    small = llama_parameters(shape)
    return {
        "parameters": counted,
        "plan_parameters": plan.seed.parameters,
        "formula_parameters": llama_parameters(SMOLLM2_1_7B),
        "ok": counted == plan.seed.parameters == llama_parameters(SMOLLM2_1_7B),
        "run_shape_parameters": small,
    }


# 4, 5, 6 ------------------------------------------------------------------------------------------------------


def documents(shape: dict[str, Any], count: int, tokens: int) -> list[Document]:
    """``count`` random documents of ``tokens`` tokens."""
    return documents_of(shape, [tokens] * count)


def documents_of(shape: dict[str, Any], lengths: list[int]) -> list[Document]:
    """Random documents of these lengths in tokens, the answer (the labelled part) their last eighth."""
    rng = random.Random(20261203)
    found = []
    for position, tokens in enumerate(lengths):
        ids = [rng.randrange(3, shape["vocab_size"]) for _ in range(tokens)]
        answer = tokens // 8
        labels = [-100] * (tokens - answer) + ids[tokens - answer :]
        found.append(Document(position, f"doc-{position}", "grounded", 8, False, answer, input_ids=ids, labels=labels))
    return found


def train(
    plan: Plan, model: torch.nn.Module, docs: list[Document], device: torch.device, wrap: bool
) -> tuple[list[float], str]:
    """``UPDATES`` updates of the real Trainer on a world of one; ``wrap``: under DDP, as a rank of a gang is."""
    world = distributed.World(rank=0, size=1, master_addr="127.0.0.1", master_port=0)
    seconds = []
    with updates.Trainer(plan, world, device, model, docs) as trainer:
        if wrap:
            trainer.network = wrap_ddp(model, device)
        batches = [list(range(u * 8, (u + 1) * 8)) for u in range(UPDATES)]
        for step, batch in enumerate(batches, start=1):
            began = clock(device)
            trainer.accumulate(batch)  # under DDP: all but the last document in no_sync, as a rank's update
            trainer.step(step)
            seconds.append(clock(device) - began)
        return seconds, distributed.parameter_digest(model)


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """``updates.wrap_ddp``; on a torch older than the project's pin (no ``forward_sync_buffers``), the same wrapper
    with ``broadcast_buffers=False``, which skips the same per-forward buffer broadcast."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return updates.wrap_ddp(model, device)
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
        bucket_cap_mb=updates.BUCKET_CAP_MB,
    )


def training_step(plan: Plan, shape: dict[str, Any], device: torch.device, tokens: int) -> dict[str, Any]:
    docs = documents(shape, 8 * UPDATES, tokens)
    reset_peak(device)
    seconds, digest = train(plan, build(shape, device), docs, device, wrap=False)
    peak, reserved = peak_memory(device), peak_reserved(device)
    _, replayed = train(plan, build(shape, device), docs, device, wrap=False)
    rule = preflight.memory_needed(plan, 1)
    return {
        "document_tokens": tokens,
        "seconds_per_update": seconds,
        "median_seconds": sorted(seconds)[len(seconds) // 2],
        "peak_memory_bytes": peak,
        "predicted_peak_memory_bytes": predicted_peak(shape, [tokens] * 8, ddp=False),
        "peak_reserved_bytes": reserved,
        "preflight_bytes": rule,
        "within_preflight": reserved is None or reserved <= rule,
        "replay_bit_identical": digest == replayed,
        "ok": digest == replayed and (reserved is None or reserved <= rule),
    }


@contextlib.contextmanager
def group_of_one(device: torch.device) -> Iterator[str]:
    """A process group of this process alone (NCCL on a GPU, gloo on a CPU); yields its backend."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def ddp_step(plan: Plan, shape: dict[str, Any], device: torch.device, tokens: int) -> dict[str, Any]:
    with group_of_one(device) as backend:
        reset_peak(device)
        seconds, _ = train(plan, build(shape, device), documents(shape, 8 * UPDATES, tokens), device, wrap=True)
        peak, reserved = peak_memory(device), peak_reserved(device)
    rule = preflight.memory_needed(plan, 2)
    return {
        "backend": backend,
        "torch_has_forward_sync_buffers": "forward_sync_buffers"
        in inspect.signature(DistributedDataParallel.__init__).parameters,
        "seconds_per_update": seconds,
        "peak_memory_bytes": peak,
        "predicted_peak_memory_bytes": predicted_peak(shape, [tokens] * 8, ddp=True),
        "peak_reserved_bytes": reserved,
        "preflight_bytes": rule,
        "ok": reserved is None or reserved <= rule,
    }


def production_ddp(plan: Plan, shape: dict[str, Any], device: torch.device, tokens: int) -> dict[str, Any]:
    """``updates.wrap_ddp`` itself in a group of one, on documents of varying lengths (the longest ``tokens``);
    its parameters after ``UPDATES`` updates against the plain Trainer's on the same documents."""
    rng = random.Random(20261204)
    lengths = [tokens] + [rng.randrange(tokens // 16, tokens + 1) for _ in range(8 * UPDATES - 1)]
    rng.shuffle(lengths)
    docs = documents_of(shape, lengths)
    world = distributed.World(rank=0, size=1, master_addr="127.0.0.1", master_port=0)
    batches = [list(range(u * 8, (u + 1) * 8)) for u in range(UPDATES)]
    with group_of_one(device) as backend:
        reset_peak(device)
        model = build(shape, device)
        seconds = []
        with updates.Trainer(plan, world, device, model, docs) as trainer:
            trainer.network = updates.wrap_ddp(model, device)  # no fallback: the wrapper the ranks run
            for step, batch in enumerate(batches, start=1):
                began = clock(device)
                trainer.accumulate(batch)
                trainer.step(step)
                seconds.append(clock(device) - began)
        wrapped = distributed.parameter_digest(model)
        peak, reserved, outside = peak_memory(device), peak_reserved(device), outside_allocator(device)
        del trainer, model
    gc.collect()
    plain_model = build(shape, device)
    with updates.Trainer(plan, world, device, plain_model, docs) as trainer:
        for step, batch in enumerate(batches, start=1):
            trainer.accumulate(batch)
            trainer.step(step)
    plain = distributed.parameter_digest(plain_model)
    rule = preflight.memory_needed(plan, 2)
    return {
        "backend": backend,
        "document_tokens": lengths,
        "seconds_per_update": seconds,
        "peak_memory_bytes": peak,
        "predicted_peak_memory_bytes": predicted_peak(shape, [tokens] * 8, ddp=True),
        "peak_reserved_bytes": reserved,
        "reserved_beyond_allocated_bytes": None if peak is None or reserved is None else reserved - peak,
        "outside_allocator_bytes": outside,
        "preflight_bytes": rule,
        "parameters_equal_the_plain_trainers": wrapped == plain,
        "ok": wrapped == plain and (reserved is None or reserved <= rule),
    }


# 7 ------------------------------------------------------------------------------------------------------------


def memory_profile(plan: Plan, shape: dict[str, Any], device: torch.device, lengths: tuple[int, ...]) -> dict[str, Any]:
    """Where the peak falls, on a world of one: updates of one document of each length, then of two documents of the
    longest length (the second runs its forward and backward on top of the first's gradients), plain and under DDP
    (a process group of one, the first document under no_sync). The first update of each makes AdamW's moments."""
    longest = max(lengths)
    docs = documents_of(shape, [*lengths, longest, longest])
    one_each = [[position] for position in range(len(lengths)) for _ in range(2)]
    two = [[len(lengths), len(lengths) + 1]] * 2
    found = {
        "one_document": profile_updates(plan, shape, device, docs, one_each, wrap=False),
        "two_documents": profile_updates(plan, shape, device, docs, two, wrap=False),
    }
    with group_of_one(device):
        found["two_documents_ddp"] = profile_updates(plan, shape, device, docs, two, wrap=True)
    return {"parameters": llama_parameters(shape), **found, "ok": True}


def profile_updates(
    plan: Plan,
    shape: dict[str, Any],
    device: torch.device,
    docs: list[Document],
    batches: list[list[int]],
    wrap: bool,
) -> list[dict[str, Any]]:
    """For each update: the memory held before it, the peak above that of its forwards and backwards, the memory
    held before its optimizer step and the step's peak above that."""

    def above(peak: int | None, held: int | None) -> int | None:
        return None if peak is None or held is None else peak - held

    world = distributed.World(rank=0, size=1, master_addr="127.0.0.1", master_port=0)
    model = build(shape, device)
    parameters = llama_parameters(shape)
    measured = []
    with updates.Trainer(plan, world, device, model, docs) as trainer:
        if wrap:
            trainer.network = wrap_ddp(model, device)
        for step, batch in enumerate(batches, start=1):
            reset_peak(device)
            held = allocated(device)
            trainer.accumulate(batch)
            backward_peak = peak_memory(device)
            reset_peak(device)
            before_step = allocated(device)
            trainer.step(step)
            lengths = [len(docs[p].input_ids) for p in batch]
            predicted = memory.update(parameters, lengths, ddp=wrap, first=step == 1)
            measured.append(
                {
                    "update": step,
                    "document_tokens": lengths,
                    "held_before_bytes": held,
                    "forward_backward_above_held_bytes": above(backward_peak, held),
                    "held_before_step_bytes": before_step,
                    "optimizer_step_above_held_bytes": above(peak_memory(device), before_step),
                    "predicted": {f"{name}_bytes": value for name, value in asdict(predicted).items()},
                }
            )
    del trainer, model
    gc.collect()
    return measured


# 8 ------------------------------------------------------------------------------------------------------------


def seed_layout(model: torch.nn.Module) -> seedmodel.TensorLayout:
    """The names the seed stores ``model``'s tensors by: the committed tiny seed's names (the SmolLM2 layout,
    tied head stored once as the embedding) for this model's layers, with this model's shapes."""
    tiny = seedmodel.tensor_layout(TINY_SEED)
    per_layer = {name.split(".", 3)[3] for name in tiny if name.startswith("model.layers.")}
    top = {name for name in tiny if not name.startswith("model.layers.")}
    layers: Any = getattr(model, "config").num_hidden_layers  # noqa: B009
    names = top | {f"model.layers.{i}.{rest}" for i in range(layers) for rest in per_layer}
    state = model.state_dict()
    return {name: tuple(state[name].shape) for name in sorted(names)}


def save_trained(plan: Plan, shape: dict[str, Any], device: torch.device, work: Path) -> dict[str, Any]:
    """One update (AdamW's moments exist: the checkpoint is full size), then its save and verification."""
    world = distributed.World(rank=0, size=1, master_addr="127.0.0.1", master_port=0)
    model = build(shape, device)
    with updates.Trainer(plan, world, device, model, documents(shape, 8, 64)) as trainer:
        trainer.accumulate(list(range(8)))
        trainer.step(1)
        layout = seed_layout(model)
        configs = work / "configs"  # the seed folder's files a checkpoint copies beside its weights
        configs.mkdir()
        (configs / "config.json").write_text(json.dumps(config_json(shape)))
        digest = distributed.parameter_digest(model)
        optimizer = trainer.optimizer
        reset_peak(device)
        began = time.monotonic()
        pointer, rss = rss_during(
            lambda: checkpoint.save(work / "run", 1, model, optimizer, "b" * 64, digest, [], configs, layout)
        )
        saved = time.monotonic()
        gpu_peak = peak_memory(device)
        receipts.verify(work / "run", pointer, "b" * 64, layout)
    return {
        "pointer": pointer,
        "layout": layout,
        "digest": digest,
        "save_seconds": saved - began,
        "verify_seconds": time.monotonic() - saved,
        "save_host": rss,
        "save_gpu_peak_bytes": gpu_peak,
    }


def checkpoint_step(plan: Plan, shape: dict[str, Any], device: torch.device, work: Path) -> dict[str, Any]:
    """A full-state checkpoint's save and verification; then, the trained state gone, the resume path's load."""
    docs = documents(shape, 8, 64)
    world = distributed.World(rank=0, size=1, master_addr="127.0.0.1", master_port=0)
    parameters = llama_parameters(shape)
    saved = save_trained(plan, shape, device, work)
    pointer, layout, digest = saved.pop("pointer"), saved.pop("layout"), saved.pop("digest")
    gc.collect()
    reset_peak(device)
    held = allocated(device)

    def resume() -> str:
        loaded = seedmodel.load_model(receipts.model_dir(work / "run", pointer)).to(device)
        with updates.Trainer(plan, world, device, loaded, docs) as fresh:
            checkpoint.load_state(work / "run", pointer, fresh.optimizer, device)
        return distributed.parameter_digest(loaded)

    began_load = time.monotonic()
    loaded_digest, load_rss = rss_during(resume)
    loaded_at = time.monotonic()
    stored = seedmodel.tensor_layout(receipts.model_dir(work / "run", pointer))
    size = sum(p.stat().st_size for p in (work / "run" / "checkpoints").rglob("*") if p.is_file())
    workspaces = memory.CUBLAS_WORKSPACE_BYTES if device.type == "cuda" else 0
    return {
        "parameters": parameters,
        **saved,
        # the GPU during the save: the trained weights and moments (the step set the gradients to None)
        "predicted_save_gpu_peak_bytes": (4 + 8) * parameters + workspaces,
        # the host during the save: the weights copied off the card, held at once while safetensors writes them
        # from their memory; on a CPU nothing (bench/results/checkpoint-rss-cpu.json)
        "predicted_save_host_above_before_bytes": memory.FLOAT32 * parameters if device.type == "cuda" else 0,
        "load_seconds": loaded_at - began_load,
        "load_host": load_rss,
        "load_gpu_held_before_bytes": held,
        "load_gpu_peak_bytes": peak_memory(device),
        # the weights, then the moments, which torch.load puts straight on the device
        "predicted_load_gpu_peak_bytes": (4 + 8) * parameters + (held or 0),
        "bytes": size,
        "plan_checkpoint_bytes": plan.checkpoint_bytes(),
        "stored_names_are_the_seeds": stored == layout,
        "loaded_parameters_are_the_saved": loaded_digest == digest,
        "ok": stored == layout and loaded_digest == digest,
    }


# 9 ------------------------------------------------------------------------------------------------------------


def evaluation_step(plan: Plan, shape: dict[str, Any], device: torch.device, max_new_tokens: int) -> dict[str, Any]:
    """The evaluation's decoding at its batch size for the plan's device (16 on a GPU), prompts up to the plan's
    longest document, against one prompt at a time."""
    numerics = plan.evaluation.numerics
    batch_size = evaluation.batch_size_for(plan.runtime.device)
    model = evaluation.answering_model(build(shape, device), device.type, numerics)
    rng = random.Random(7)
    longest = plan.corpus.max_document_tokens - max_new_tokens
    lengths = [longest] + [rng.randrange(40, longest) for _ in range(EVAL_PROMPTS - 1)]
    prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(length)] for length in lengths]
    eos = pad = 2
    gc.collect()
    reset_peak(device)
    began = clock(device)
    batched = decoding.generate(model, prompts, eos, pad, max_new_tokens, batch_size=batch_size)
    batched_seconds = clock(device) - began
    peak = peak_memory(device)
    answering = memory.evaluation(
        msgspec.structs.replace(
            plan, evaluation=msgspec.structs.replace(plan.evaluation, max_new_tokens=max_new_tokens)
        ),
        Shape.of(shape),
        batch_size,
        decoding.PREFILL_ROWS,
        prompt_tokens=longest,
    )
    began = clock(device)
    alone = decoding.generate(model, prompts, eos, pad, max_new_tokens, batch_size=1)
    alone_seconds = clock(device) - began
    rows = list(zip(batched, alone, strict=True))
    pairs = [(a, b) for x, y in rows for a, b in zip(x.output_ids, y.output_ids, strict=False)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    same_rows = sum(x.output_ids == y.output_ids for x, y in rows)
    finite = finite_rows(model, prompts[:batch_size], pad, device)
    return {
        "numerics": numerics,
        "prompts": len(prompts),
        "longest_prompt_tokens": longest,
        "batch_size": batch_size,
        "batched_seconds": batched_seconds,
        "batched_peak_memory_bytes": peak,
        "predicted_peak_memory_bytes": answering.allocated,
        "predicted_terms": {term.name: term.bytes for term in answering.terms},
        "one_at_a_time_seconds": alone_seconds,
        "token_agreement": agreement,
        "identical_rows": same_rows,
        "rows_without_nan": finite,
        "ok": finite == min(batch_size, len(prompts)),
    }


@torch.inference_mode()
def finite_rows(model: torch.nn.Module, prompts: list[list[int]], pad: int, device: torch.device) -> int:
    """Rows of one left-padded batch whose next-token logits are all finite."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    logits = model(ids, attention_mask=mask)[:, -1]
    return int(torch.isfinite(logits).all(dim=-1).sum())


# --------------------------------------------------------------------------------------------------------------


def memory_model(plan: Plan) -> list[dict[str, Any]]:
    """experiment.learning.memory's estimates for the plan's processes, term by term, and what each leaves of an
    L40S."""
    utilization = ReplicaSpec(model_dir=REFERENCE_PLAN, served_model_name="seed", port=1).gpu_memory_utilization
    estimates = [
        memory.training_rank(plan, 1),
        memory.training_rank(plan, plan.training.pair_world_size),
        memory.evaluation(plan, memory.SMOLLM2_1_7B, evaluation.CUDA_BATCH_SIZE, decoding.PREFILL_ROWS),
        memory.replica(L40S_MEMORY_BYTES, utilization),
    ]
    return [
        {
            "what": estimate.what,
            "terms": [asdict(term) for term in estimate.terms if term.bytes],
            "allocated_bytes": estimate.allocated,
            "total_bytes": estimate.total,
            "l40s_left_bytes": L40S_MEMORY_BYTES - estimate.total,
        }
        for estimate in estimates
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="a CPU and a small model of the same family")
    parser.add_argument("--work", type=Path, help="where the checkpoint is written (default: a temporary folder)")
    parser.add_argument("--steps", help="a comma-separated subset of the steps, by name (default: every step)")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible; use --dry-run on a CPU", file=sys.stderr)
        return 2
    plan = load_plan(REFERENCE_PLAN)
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    shape = DRY_RUN_SHAPE if args.dry_run else SMOLLM2_1_7B
    tokens = 128 if args.dry_run else plan.corpus.max_document_tokens
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, L40S_MEMORY_BYTES / torch.cuda.get_device_properties(device).total_memory), device
        )
    determinism.make_deterministic(device.type, plan.runtime.cpu_threads if device.type == "cuda" else 1)
    result: dict[str, Any] = {
        "dry_run": args.dry_run,
        "plan": plan.name,
        "memory_cap_bytes": L40S_MEMORY_BYTES,
        "memory_model": memory_model(plan),
    }
    with tempfile.TemporaryDirectory(prefix="coop-gpu-check-", dir=args.work) as work:
        steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("versions", lambda: versions(device)),
            ("deterministic_mode", lambda: deterministic_mode(device)),
            ("shape", lambda: shape_check(shape, plan)),
            ("training_step", lambda: training_step(plan, shape, device, tokens)),
            ("ddp_group_of_one", lambda: ddp_step(plan, shape, device, tokens)),
            ("production_ddp", lambda: production_ddp(plan, shape, device, tokens)),
            (
                "memory_profile",
                lambda: memory_profile(plan, shape, device, (32, 128) if args.dry_run else PROFILE_TOKENS),
            ),
            ("checkpoint", lambda: checkpoint_step(plan, shape, device, Path(work))),
            ("evaluation", lambda: evaluation_step(plan, shape, device, 96 if device.type == "cuda" else 24)),
        ]
        if args.steps:
            chosen = args.steps.split(",")
            unknown = sorted(set(chosen) - {name for name, _ in steps})
            if unknown:
                print(f"gpu-check: no step named {', '.join(unknown)}", file=sys.stderr)
                return 2
            steps = [(name, step) for name, step in steps if name in chosen]
        for number, (name, step) in enumerate(steps, start=1):
            emit({"event": "gpu-check", "step": name, "done": number - 1, "total": len(steps)})
            gc.collect()  # what an earlier step left in a reference cycle is not counted against this one
            if device.type == "cuda":
                torch.cuda.empty_cache()
            held = allocated(device)
            began = time.monotonic()
            try:
                result[name] = step() | {"step_seconds": round(time.monotonic() - began, 3)}
            except Exception as exc:  # every step reports: one failure hides no other
                result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            result[name]["held_at_start_bytes"] = held
            result[name]["outside_allocator_after_bytes"] = outside_allocator(device)
    failed = [name for name, value in result.items() if isinstance(value, dict) and value.get("ok") is False]
    result["failed"] = failed
    print(json.dumps(result, indent=2, default=lambda v: v if math.isfinite(v) else str(v)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
