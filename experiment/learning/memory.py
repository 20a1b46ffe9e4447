"""GPU memory from the shapes: what a training rank, an evaluation and a vLLM replica hold at their peak, term by term,
in bytes, from the plan and the seed's config (pure Python: the doctor and the pages read it without torch).

The per-parameter terms are first principles: float32 weights and gradients (4 B a parameter each), AdamW's two
moments (8 B), a later document's gradient before autograd adds it to the accumulated one (4 B, when a rank runs more
than one document an update), DDP's gradient buckets (4 B, in a group of more than one) and the temporary of AdamW's
foreach step (4 B; the first step also makes the moments, 12 B in all). Two terms are calibrated, not derived: the
activations of a document's forward and backward, a straight line through the two document lengths measured on an
H200 (256 and 1,024 tokens, ``ACTIVATION_BYTES``), and the cuBLAS workspaces (64 MiB, held from the first matmul on).
Both come from ``bench/results/gpu-check-h200.json`` (SmolLM2-1.7B's shape, bf16 autocast, torch 2.11). Under autocast
the peak falls late in the backward, once most float32 gradients exist, so the activations left there grow by only
about 160 KB a token; past 1,024 tokens the line is an extrapolation, and a document several times longer could move
the peak to the end of the forward, where every layer's activations are held. Another seed's shape scales the
calibrated figures by its parameter count, an assumption that no measurement backs. Outside torch's allocator (not in
``torch.cuda.max_memory_allocated``): the CUDA context and NCCL's buffers, both estimates, not measured
(bench/gpu_check.py measures the context, and a group of one's NCCL; two hosts' NCCL has never run).

The measured peaks it reproduces: one rank, 8 documents of 1,024 tokens an update, 20 B a parameter plus the
activations and workspaces (34.82 GB); a rank under DDP, 24 B a parameter plus the same (41.67 GB). The gradients
set the peak, not the activations (tests/unit/test_memory_model.py holds every figure of the JSON to 5 %)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from experiment.core.plan import Numerics, Plan
from experiment.seed.shape import Shape

# How a term's bytes are known: by counting, by a measurement of that very quantity, by a line through measurements,
# or by an estimate that no measurement here backs.
Basis = Literal["first principles", "measured", "calibrated", "estimate"]

FLOAT32 = 4
NUMERICS_BYTES: dict[Numerics, int] = {"float32": 4, "bfloat16": 2}
MIB = 2**20

# What nvidia-smi reports an L40S has (46,068 MiB), the card of the reference plan's g6e.xlarge hosts.
L40S_BYTES = 46_068 * MIB
# The cuBLAS and cuBLASLt workspaces torch allocates at the first matmul and keeps: 64 MiB in every figure the H200
# check held after its first step (under CUBLAS_WORKSPACE_CONFIG=:4096:8, two workspaces of 8 x 4 MiB).
CUBLAS_WORKSPACE_BYTES = 64 * MIB
# A process's CUDA context (the driver's, and the kernels it loads): outside torch's allocator. An estimate: what
# a torch process takes on a card before its first allocation, about 0.6 GB; bench/gpu_check.py measures it.
CUDA_CONTEXT_BYTES = 600 * MIB
# NCCL's communicator between two hosts: its channels' buffers for each protocol, its FIFOs and its kernels, outside
# torch's allocator. An estimate, not measured: no two-host NCCL has run (the canary measures it).
NCCL_BYTES = 512 * MIB

# The forward and backward of one document above the gradients it makes, at two lengths in tokens, for the shape
# of CALIBRATION_PARAMETERS: bench/results/gpu-check-h200.json's memory_profile.one_document (the peak above the
# memory held, less 4 B a parameter of gradients).
ACTIVATION_BYTES = {256: 404_753_920, 1024: 527_791_616}


# SmolLM2-1.7B-Instruct's config.json: the reference seed, and the shape the calibrated terms were measured on.
SMOLLM2_1_7B = Shape(
    vocab_size=49_152,
    hidden_size=2_048,
    intermediate_size=8_192,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=32,
)
CALIBRATION_PARAMETERS = SMOLLM2_1_7B.parameters


@dataclass(frozen=True)
class Term:
    """One part of a process's GPU memory at its peak; ``allocator``: counted by torch's caching allocator."""

    name: str
    bytes: int
    basis: Basis
    allocator: bool = True


@dataclass(frozen=True)
class Estimate:
    """What one process holds on its GPU at its peak, term by term."""

    what: str
    terms: tuple[Term, ...]

    @property
    def allocated(self) -> int:
        """What torch's allocator has handed out at the peak (``torch.cuda.max_memory_allocated``)."""
        return sum(t.bytes for t in self.terms if t.allocator)

    @property
    def total(self) -> int:
        """Every term, those outside torch's allocator included."""
        return sum(t.bytes for t in self.terms)

    def term(self, name: str) -> int:
        """The bytes of the term ``name`` (0 where the process has none)."""
        return sum(t.bytes for t in self.terms if t.name == name)

    def describe(self) -> str:
        """The terms, for a message a person reads: ``weights 6.8 GB (first principles), ...``."""
        return ", ".join(f"{t.name} {t.bytes / 1e9:.2f} GB ({t.basis})" for t in self.terms if t.bytes)


def _scaled(parameters: int, calibrated: float) -> int:
    return round(calibrated * parameters / CALIBRATION_PARAMETERS)


def activations(parameters: int, tokens: int) -> int:
    """The peak of one document's forward and backward above the gradients it makes (calibrated, see above)."""
    (short, short_bytes), (long, long_bytes) = sorted(ACTIVATION_BYTES.items())
    per_token = (long_bytes - short_bytes) / (long - short)
    return _scaled(parameters, short_bytes + per_token * (tokens - short))


@dataclass(frozen=True)
class Update:
    """One update's memory on a rank, as bench/gpu_check.py's memory profile records it: what is held before it, the
    peak of its forwards and backwards above that, what is held before its optimizer step and the step's peak above
    that (the allocator's figures)."""

    held_before: int
    forward_backward_above_held: int
    held_before_step: int
    optimizer_step_above_held: int

    @property
    def peak(self) -> int:
        return max(
            self.held_before + self.forward_backward_above_held,
            self.held_before_step + self.optimizer_step_above_held,
        )


def update(parameters: int, document_tokens: Sequence[int], ddp: bool, first: bool) -> Update:
    """A rank's update over its documents of these lengths in tokens; ``ddp``: wrapped in DDP (its buckets made at
    wrapping, the gradients views of them after the reduction); ``first``: AdamW has no moments yet. Each later
    document runs its backward beside the gradients the earlier ones left, so its own gradient is 4 B a parameter
    more; bounded here by the longest document's activations."""
    weights = gradients = buckets = FLOAT32 * parameters
    moments = 0 if first else 2 * FLOAT32 * parameters
    held = weights + moments + (buckets if ddp else 0) + CUBLAS_WORKSPACE_BYTES
    later = gradients if len(document_tokens) > 1 else 0
    return Update(
        held_before=held,
        forward_backward_above_held=gradients + later + activations(parameters, max(document_tokens)),
        # under DDP the reduced gradients are the buckets' views; alone, they are the gradients autograd made
        held_before_step=weights + moments + (buckets if ddp else gradients) + CUBLAS_WORKSPACE_BYTES,
        # the first step makes both moments; every step's foreach arithmetic takes one float32 temporary
        optimizer_step_above_held=(3 if first else 1) * FLOAT32 * parameters,
    )


def local_documents(plan: Plan, world_size: int) -> int:
    """The documents rank 0 of ``world_size`` runs each update (experiment.learning.updates.local_positions)."""
    return -(-plan.training.documents_per_update // world_size)


def _outside(plan: Plan, world_size: int) -> list[Term]:
    if plan.runtime.device != "cuda":
        return []
    terms = [Term("cuda context", CUDA_CONTEXT_BYTES, "estimate", allocator=False)]
    if world_size > 1 and plan.runtime.backend == "nccl":
        terms.append(Term("nccl buffers", NCCL_BYTES, "estimate", allocator=False))
    return terms


def training_phases(plan: Plan, world_size: int) -> tuple[Estimate, Estimate]:
    """A rank of a ``world_size``-rank run of ``plan`` at the peak of each phase of a later update: its last
    document's forward and backward at the plan's longest document, and its optimizer step."""
    parameters = plan.seed.parameters
    documents = local_documents(plan, world_size)
    ddp = world_size > 1
    p4 = FLOAT32 * parameters
    common = [
        Term("weights", p4, "first principles"),
        Term("adam moments", 2 * p4, "first principles"),
        Term("ddp buckets", p4 if ddp else 0, "first principles"),
        Term("cublas workspaces", CUBLAS_WORKSPACE_BYTES if plan.runtime.device == "cuda" else 0, "measured"),
    ]
    outside = _outside(plan, world_size)
    backward = Estimate(
        f"a rank of a {world_size}-rank run: the backward of its last document",
        (
            *common,
            Term("gradients", p4, "first principles"),
            Term("later document's gradient", p4 if documents > 1 else 0, "first principles"),
            Term("activations", activations(parameters, plan.corpus.max_document_tokens), "calibrated"),
            *outside,
        ),
    )
    step = Estimate(
        f"a rank of a {world_size}-rank run: its optimizer step",
        (
            *common,
            Term("gradients", 0 if ddp else p4, "first principles"),  # under DDP, views of the buckets
            Term("optimizer step temporary", p4, "first principles"),
            *outside,
        ),
    )
    return backward, step


def training_rank(plan: Plan, world_size: int) -> Estimate:
    """A rank of a ``world_size``-rank run of ``plan`` at its peak: the larger of its phases (the first update's
    peak is no higher: it holds no moments during its backward, and its step makes them)."""
    return max(training_phases(plan, world_size), key=lambda estimate: estimate.allocated)


def evaluation(
    plan: Plan, shape: Shape, batch_size: int, prefill_rows: int, prompt_tokens: int | None = None
) -> Estimate:
    """An evaluation of ``plan`` (experiment.learning.decoding): the weights in the plan's numerics, the key-value
    cache reserved for a batch of ``batch_size`` prompts of ``prompt_tokens`` (by default the plan's longest
    document, which bounds a prompt) and their answers, and the prefill's transient (``prefill_rows`` prompts a
    forward: the gated MLP's three intermediate tensors and, should SDPA take its math path, the attention scores),
    an estimate."""
    width = prompt_tokens or plan.corpus.max_document_tokens
    size = NUMERICS_BYTES[plan.evaluation.numerics]
    capacity = width + plan.evaluation.max_new_tokens
    kv_per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * size
    rows = min(batch_size, prefill_rows)
    mlp = 3 * rows * width * shape.intermediate_size * size
    scores = rows * shape.num_attention_heads * width * width * size
    return Estimate(
        f"an evaluation in {plan.evaluation.numerics}, batches of {batch_size}",
        (
            Term("weights", size * shape.parameters, "first principles"),
            Term("kv cache", batch_size * capacity * kv_per_token, "first principles"),
            Term("prefill transient", mlp + scores, "estimate"),
            Term("cublas workspaces", CUBLAS_WORKSPACE_BYTES if plan.runtime.device == "cuda" else 0, "measured"),
            *_outside(plan, 1),
        ),
    )


def replica(card_bytes: int, gpu_memory_utilization: float) -> Estimate:
    """A vLLM replica on a card of ``card_bytes``: vLLM sizes its KV cache so that its whole process (weights,
    activations, cache, CUDA context) takes ``gpu_memory_utilization`` of the card, and refuses to start where
    less is free."""
    return Estimate(
        f"a vLLM replica at --gpu-memory-utilization {gpu_memory_utilization:g}",
        (Term("vllm reservation", int(gpu_memory_utilization * card_bytes), "first principles", allocator=False),),
    )
