"""The records the science writes and the coordinator receives, defined once and bounded, so that a line of a
journal or of answers.jsonl is the same Struct on every side: a training step, a resource sample, an evaluated
answer, an arm's selected candidate, a checkpoint's pointer, a rank's run result and an evaluation's summary. Light
(msgspec only): the agent and the coordinator import it without torch."""

from __future__ import annotations

from typing import Annotated, TypedDict

import msgspec

from experiment.core.plan import Numerics
from experiment.core.tasks import Check, Family

# Integers a 32-bit database column holds; every count in these records fits.
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Step = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
# What a rank's arithmetic depends on (experiment.learning.profile.numerical_profile): library versions, device,
# threads and determinism flags, each a scalar.
NumericalProfile = dict[str, str | int | bool | None]


class StepRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One update of a rank's step journal; ``positions`` are the global batch's document positions."""

    step: Step
    positions: list[Count]
    local_positions: list[Count]
    loss: float
    learning_rate: float
    gradient_norm: float
    targets: Count
    weighted_targets: Count
    documents: Count
    seconds: float
    # What the rank's process wrote during the update (/proc/self/io wchar): its collectives' socket writes on a
    # CPU gloo gang, the sum a ring all-reduce's theory is checked against.
    written_bytes: Bytes = 0


class GpuMemory(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A GPU rank's memory at a sample: what torch has allocated on its device, and what the preflight asked of the
    rank before its first update (experiment.learning.preflight.memory_needed)."""

    allocated_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    preflight_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class ResourceSample(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One whole-process resource sample, ``seconds`` after the sampler started; on a GPU, with the rank's GPU
    memory (a CPU sample writes no ``gpu`` field)."""

    seconds: float
    rss_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    cpu_user_seconds: float
    cpu_system_seconds: float
    threads: Count
    gpu: GpuMemory | None = None


class Answer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One evaluated answer: a line of answers.jsonl."""

    id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    index: Count
    family: Family
    variant: Count
    input_dependent: bool
    prompt_ids: list[Count]
    output_ids: list[Count]
    text: str
    seconds: float  # the batch's wall time shared equally among its answers
    ended_with_eos: bool
    hit_token_limit: bool
    check: Check


class Candidate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An arm's selected model: for a trained arm its verified final checkpoint, for the untouched seed the
    identity of its file snapshot (and nothing else)."""

    arm: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    model_identity: Sha256  # the final parameter digest; for the seed, the identity of its file snapshot
    path: Annotated[str, msgspec.Meta(max_length=500)] | None = None  # the model folder relative to the home
    step: Step | None = None
    binding: Sha256 | None = None
    receipt_sha256: Sha256 | None = None

    @property
    def is_checkpoint(self) -> bool:
        """A trained arm's candidate names every part of its checkpoint."""
        return None not in (self.path, self.step, self.binding, self.receipt_sha256)

    @property
    def model_path(self) -> str:
        """A trained arm's model folder relative to the home."""
        if self.path is None:
            raise ValueError(f"the candidate of {self.arm} is the untouched seed, not a checkpoint")
        return self.path


class SeedRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    revision: str
    snapshot_identity: Sha256


class FileRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    sha256: Sha256


class RoleFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    file: str  # relative to the prepared folder
    sha256: Sha256


class TargetCounts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One training copy's documents and their supervised targets, in all and by kind (weighted by the plan)."""

    documents: int
    grounded_documents: int
    replay_documents: int
    damaged_documents: int
    targets: int
    grounded_targets: int
    replay_targets: int
    weighted_targets: int
    grounded_weighted_targets: int


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The prepared inputs' manifest (prepared/manifest.json): its identity is the prepared identity, committed
    before training. ``roles`` names each role file and its sha256; ``ids`` the task ids of each role in order."""

    plan: str
    plan_identity: Sha256
    seed: SeedRecord
    tokenizer_identity: Sha256
    sources: dict[str, FileRecord]  # "replay", "retention": the files the plan names, as read
    roles: dict[str, RoleFile]
    ids: dict[str, list[str]]  # "train", "dev", "test", "retention"
    damaged_ids: list[str]
    target_counts: dict[str, TargetCounts]  # "clean", "damaged"
    retention_targets: int


class Pointer(msgspec.Struct, frozen=True):
    """A checkpoint a rank holds whole (pointers/step-NNNNNN.json)."""

    step: int
    checkpoint: str  # folder name under checkpoints/
    receipt_sha256: str


class NetworkCounters(msgspec.Struct, frozen=True):
    """Counters of every non-loopback interface: they include other traffic of the whole host."""

    scope: str
    interfaces: dict[str, dict[str, int]]
    bytes_sent: int
    bytes_received: int


class Communication(TypedDict, total=False):
    """How a rank's collectives ran (updates.communication_profile): the interface they were pinned to (None: the
    backend chose), NCCL's version on CUDA, the NCCL_*, TORCH_NCCL_* and GLOO_* variables; a DiLoCo arm's outer
    synchronization besides (training._synchronization)."""

    interface: str | None
    nccl: str | None
    environment: dict[str, str]
    synchronization: str
    sync_every: int
    outer_steps: int
    outer_allreduce_bytes: int


class Result(msgspec.Struct, frozen=True):
    """A rank's finished run (runs/ARM/rank-R/result.json), written once after the plan's last update."""

    arm: str
    rank: int
    world_size: int
    binding: str
    prepared_identity: str
    numerical_profile: NumericalProfile
    parameter_digest: str
    candidate: Pointer
    journal: list[StepRecord]
    loop_seconds: float
    resumed_from_step: int
    network_start: NetworkCounters
    network_end: NetworkCounters
    peak_memory_bytes: int
    peak_memory_kind: str
    resource_samples: list[ResourceSample]
    communication: Communication = msgspec.field(default_factory=Communication)


class RetentionScore(msgspec.Struct, frozen=True):
    """One retention probe's mean nats per answer token: a line of retention.jsonl."""

    id: str
    targets: int
    mean_nats: float


class Summary(msgspec.Struct, frozen=True):
    """A finished evaluation (evaluations/ROLE/ARM/evaluation.json), naming its answers' and scores' hashes."""

    arm: str
    role: str
    prepared_identity: str
    candidate: Candidate
    selection_identity: str | None
    max_new_tokens: int
    batch_size: int
    answers: int
    correct: int
    answers_sha256: str
    retention_sha256: str
    retention_mean_nats: float
    # The dtype the model answered and scored retention in (plan.evaluation.numerics); absent in a summary written
    # before the field, whose evaluation answered in float32.
    numerics: Numerics = "float32"
