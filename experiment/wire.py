"""The coordinator's wire schema: every request and response body that agents, operators and the server
exchange, as msgspec Structs so that both sides validate the same messages."""

from __future__ import annotations

import datetime
import ipaddress
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar, get_args

import msgspec

from experiment.core.canonical import JsonObject
from experiment.core.ledger import Entry as LedgerEntry
from experiment.core.plan import ArmName
from experiment.core.states import ExperimentState, JobState
from experiment.learning.events import CanaryStep
from experiment.learning.records import Answer, Candidate, ResourceSample, StepRecord
from experiment.serving.servingrecord import Phase

Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
# Integers the coordinator stores in 32-bit columns: every inbound integer is bounded to what its column holds.
INT32_MAX = 2**31 - 1
Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=INT32_MAX)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
Step = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
# A moment with its time zone: a naive time is refused, since the coordinator cannot know which zone it meant.
Moment = Annotated[datetime.datetime, msgspec.Meta(tz=True)]
# A file's path inside the evidence bundle (docs/evidence.md), e.g. ``runs/clean-pair/rank-1/result.json``;
# the server also refuses empty, ``.`` and ``..`` segments.
BundlePath = Annotated[str, msgspec.Meta(min_length=1, max_length=500, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")]


JobKind = Literal[
    "canary", "prepare", "train", "evaluate", "select", "replica-start", "replica-stop", "benchmark", "report"
]
# The kinds whose command computes on the host's accelerator. vLLM reserves 90% of a GPU's memory, so a host that
# holds a replica claims none of them (a retried evaluation of the seed waits for a host with a free GPU).
ACCELERATOR_KINDS: frozenset[JobKind] = frozenset({"train", "evaluate"})
Role = Literal["dev", "test"]
TokenRole = Literal["operator", "agent", "reader"]
# "lost": the agent lost track of the command (it restarted while the command ran); the job is retried.
Outcome = Literal["succeeded", "failed", "cancelled", "lost"]
MeasurementKind = Literal["step", "resources"]
Family = Literal["lookup", "filter", "total", "sort"]
CheckReason = Literal["correct", "wrong_schema_or_value", "invalid_json_object"]
ServingPhaseName = Phase  # the benchmark's phases (experiment.serving.servingrecord)
# An arm's name (experiment.core.plan.ArmName): which arms exist is each experiment's plan's to say, and the coordinator
# refuses a name its plan lacks.
__all__ = ["Answer", "ArmName", "Candidate", "LedgerEntry", "ResourceSample", "StepRecord"]


class Health(msgspec.Struct, frozen=True):
    """The coordinator answers: its process serves HTTP (it reads no database)."""

    status: Literal["ok"] = "ok"


class Problem(msgspec.Struct, frozen=True):
    """Every refusal: the HTTP status, a message a person can act on, and the rule broken (409s)."""

    status_code: int
    detail: str
    rule: str | None = None
    extra: dict[str, Any] | list[Any] | None = None


# Experiments -----------------------------------------------------------------------------------


class ExperimentCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    plan_toml: Annotated[str, msgspec.Meta(min_length=1, max_length=1_000_000)]
    # Commit the plan at once (the usual case); False leaves the experiment in draft.
    commit: bool = True
    # Advance each phase as soon as the last one's jobs succeeded; off: one operator action per phase.
    autopilot: bool = True
    # Commit a GPU plan without a passing canary: the operator's reason, recorded in the plan's commitment.
    canary_override: Annotated[str, msgspec.Meta(min_length=1, max_length=500)] | None = None


class PlanCommit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Commit a GPU plan without a passing canary: the operator's reason, recorded in the plan's commitment.
    canary_override: Annotated[str, msgspec.Meta(min_length=1, max_length=500)] | None = None


class AutopilotSet(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    on: bool


class Experiment(msgspec.Struct, frozen=True):
    id: uuid.UUID
    name: str
    state: ExperimentState
    plan_identity: str
    prepared_identity: str | None
    selection_identity: str | None
    autopilot: bool
    created_at: datetime.datetime
    updated_at: datetime.datetime


class Advanced(msgspec.Struct, frozen=True):
    """What an advance did: the experiment afterwards and a sentence saying what was queued or committed."""

    experiment: Experiment
    action: str


class Arm(msgspec.Struct, frozen=True):
    id: uuid.UUID
    experiment_id: uuid.UUID
    name: ArmName
    world_size: int
    serving_eligible: bool
    final_step: int | None
    model_identity: str | None
    receipt_sha256: str | None


class PreparedCommit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prepared_identity: Sha256


class SelectedArm(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    step: Step
    model_identity: Sha256


class SelectionCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per trained arm, the checkpoint chosen: it must be the arm's verified final checkpoint."""

    arms: dict[str, SelectedArm]


class ServingCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    arm: ArmName
    model_identity: Sha256


# Jobs and attempts -----------------------------------------------------------------------------


# What each job kind is given (its spec) and what it returns (its result): one msgspec tagged union each, the tag
# being the job's kind. On the wire a spec or result is the untagged object beside its job's ``kind`` (the kind is
# the tag, said once): ``decode`` reads one strictly as its kind's type (the string "1" is no rank), ``untagged``
# writes one. A new job kind adds its spec and result here, and one entry to each side's table of kinds (the
# coordinator's server/protocol/kinds.py, the agent's agent/jobs.py).

Rank = Annotated[int, msgspec.Meta(ge=0, le=63)]
Url = Annotated[str, msgspec.Meta(min_length=1, max_length=500)]


class Tagged(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, tag_field="kind"):
    """A spec or result; its tag is its job's kind."""


class CanarySpec(Tagged, tag="canary", frozen=True):
    """Try every step only the real hosts can fail (experiment.serving.canary), one rank per host of the plan's
    largest gang, before the plan is committed. The coordinator fills in the draft's plan when it queues the job."""

    plan_toml: Annotated[str, msgspec.Meta(max_length=1_000_000)] = ""


class PrepareSpec(Tagged, tag="prepare", frozen=True):
    """Prepare the inputs the plan names; the committed plan says everything."""


class TrainSpec(Tagged, tag="train", frozen=True):
    """Train the job's arm (one rank per gang member)."""


class EvaluateSpec(Tagged, tag="evaluate", frozen=True):
    """Evaluate the job's arm on the job's role."""


class SelectSpec(Tagged, tag="select", frozen=True):
    """Verify the job's arm's final checkpoint on the host that holds it."""


class ServingSpec(Tagged, frozen=True):
    # The probes' bearer token: the coordinator adds it to the claim of a serving job only, and stores it nowhere.
    serving_token: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None


class ReplicaStartSpec(ServingSpec, tag="replica-start", frozen=True, kw_only=True):
    rank: Rank  # the rank of the served arm's gang whose checkpoint copy this host serves


class ReplicaStopSpec(ServingSpec, tag="replica-stop", frozen=True, kw_only=True):
    rank: Rank


class BenchmarkSpec(ServingSpec, tag="benchmark", frozen=True, kw_only=True):
    phase: Phase
    # The running replicas' probes, chosen by the coordinator when it queues the job.
    endpoints: Annotated[list[Url], msgspec.Meta(max_length=64)] = []


class ReportSpec(Tagged, tag="report", frozen=True):
    """Recompute the report from the stored evidence (the coordinator's own job)."""


JobSpec = (
    CanarySpec
    | PrepareSpec
    | TrainSpec
    | EvaluateSpec
    | SelectSpec
    | ReplicaStartSpec
    | ReplicaStopSpec
    | BenchmarkSpec
    | ReportSpec
)


class CanaryResult(Tagged, tag="canary", frozen=True):
    """One host's canary: passed only if every step did; each step's figures, and a failed step's reason and fix."""

    passed: bool
    steps: Annotated[list[CanaryStep], msgspec.Meta(max_length=16)]


class PrepareResult(Tagged, tag="prepare", frozen=True):
    prepared_identity: Sha256


class TrainResult(Tagged, tag="train", frozen=True):
    step: Step
    model_identity: Sha256
    receipt_sha256: Sha256
    final: bool
    binding: Sha256 | None = None
    # The final checkpoint's model folder relative to the experiment home (experiment.learning.records.Candidate.path).
    checkpoint_path: Annotated[str, msgspec.Meta(max_length=500)] | None = None


class EvaluateResult(Tagged, tag="evaluate", frozen=True):
    answers_sha256: Sha256  # the answers.jsonl blob the result names as evidence


class SelectResult(Tagged, tag="select", frozen=True):
    """A select job's result: the arm's final checkpoint as its host verified it."""

    candidate: Candidate

    def __post_init__(self) -> None:
        if not self.candidate.is_checkpoint:
            raise ValueError("a verified candidate names its checkpoint's path, step, binding and receipt")


class ReplicaStartResult(Tagged, tag="replica-start", frozen=True):
    """The replica and probe a host started; both outlive the job."""

    model_identity: Sha256
    replica_url: Url
    probe_url: Url
    rank: Rank
    # The probe's check of the replica's answers against the arm's dev evaluation (its /health body's identity, an
    # experiment.serving.agreement.Agreement); {} when the probe checked none.
    identity: Annotated[dict[str, int | float | str | None], msgspec.Meta(max_length=64)] = {}


class ReplicaStopResult(Tagged, tag="replica-stop", frozen=True):
    stopped: bool  # False: no replica of the experiment ran on the host


class BenchmarkResult(Tagged, tag="benchmark", frozen=True):
    """A summary; the phase's whole record travels as AttemptResult.serving."""

    phase: Phase | None = None
    # The phase's experiment.serving.servingrecord.Metrics: counts, seconds and rates (None: no latency measured).
    metrics: Annotated[dict[str, int | float | None], msgspec.Meta(max_length=64)] = {}


class ReportResult(Tagged, tag="report", frozen=True):
    report_identity: Sha256  # the recorded report's blob (its canonical bytes)


JobResult = (
    CanaryResult
    | PrepareResult
    | TrainResult
    | EvaluateResult
    | SelectResult
    | ReplicaStartResult
    | ReplicaStopResult
    | BenchmarkResult
    | ReportResult
)
SPECS: dict[str, type[JobSpec]] = {kind.__struct_config__.tag: kind for kind in get_args(JobSpec)}
RESULTS: dict[str, type[JobResult]] = {kind.__struct_config__.tag: kind for kind in get_args(JobResult)}
if set(SPECS) != set(get_args(JobKind)) or set(RESULTS) != set(SPECS):
    raise TypeError("every job kind (JobKind) has one spec (JobSpec) and one result (JobResult)")
T = TypeVar("T", bound=Tagged)


def kind_of(value: Tagged) -> JobKind:
    """The job kind a spec or result belongs to (its tag)."""
    tag: JobKind = value.__struct_config__.tag  # type: ignore[assignment]
    return tag


def decode(body: Mapping[str, Any], kind: type[T]) -> T:
    """A spec or result as its kind's type, from the untagged object the wire carries; raises
    msgspec.ValidationError naming the field."""
    return msgspec.convert(body, kind, strict=True)


def spec_of(kind: str, body: Mapping[str, Any]) -> JobSpec:
    """A job's spec from its kind and the untagged object beside it."""
    return decode(body, SPECS[kind])


def untagged(value: Tagged) -> JsonObject:
    """A spec or result as the wire carries it: beside its job's kind, so without its tag."""
    body: JsonObject = msgspec.to_builtins(value)
    del body["kind"]
    return body


class JobCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: JobKind
    arm: ArmName | None = None
    role: Role | None = None
    spec: dict[str, Any] = {}  # the kind's spec (JobSpec), untagged


class Job(msgspec.Struct, frozen=True):
    id: uuid.UUID
    experiment_id: uuid.UUID
    kind: JobKind
    arm: ArmName | None
    role: Role | None
    world_size: int
    state: JobState
    attempts_made: int
    max_attempts: int
    spec: dict[str, Any]  # the kind's spec (JobSpec), untagged
    pinned_agent_id: uuid.UUID | None
    created_at: datetime.datetime


class CanaryHost(msgspec.Struct, frozen=True):
    """One rank of a canary: its agent, its attempt's state and, once it reported, its steps."""

    rank: int
    agent: str
    state: JobState
    reason: str | None
    passed: bool | None  # None: no result yet
    steps: list[CanaryStep]


class Canary(msgspec.Struct, frozen=True):
    """An experiment's latest canary job (server/protocol/canaries.py)."""

    job_id: uuid.UUID
    state: JobState
    passed: bool
    hosts: list[CanaryHost]
    failures: list[str]  # each failed step, with its host and fix


class Attempt(msgspec.Struct, frozen=True):
    id: uuid.UUID
    job_id: uuid.UUID
    number: int
    rank: int
    agent_id: uuid.UUID | None  # None: the coordinator's own attempt (a report job)
    state: JobState
    lease_expires_at: datetime.datetime
    master_addr: str | None
    master_port: int | None
    cancel_deadline: datetime.datetime | None
    exit_code: int | None
    reason: str | None
    created_at: datetime.datetime


class CancelRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    grace_seconds: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 30.0


# Agents ----------------------------------------------------------------------------------------


LabelKey = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
LabelValue = Annotated[str, msgspec.Meta(max_length=256)]


class AgentRegister(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # The address other hosts reach this agent at: its probe's, and a gang's rendezvous without a private one.
    address: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    # Host facts (agent.loop.host_facts): a few short pairs, published on every GET /api/agents.
    labels: Annotated[dict[LabelKey, LabelValue], msgspec.Meta(max_length=32)] = {}
    # The IP address of the host's private interface, the one a gang's ranks talk over: rank 0's becomes the
    # gang's MASTER_ADDR. None: the host has no private link, and its gangs meet at ``address``.
    private_address: Annotated[str, msgspec.Meta(min_length=2, max_length=45)] | None = None

    def __post_init__(self) -> None:
        if self.private_address is not None:
            try:
                ipaddress.ip_address(self.private_address)
            except ValueError:
                raise ValueError(f"private_address {self.private_address!r} is not an IP address") from None


class Agent(msgspec.Struct, frozen=True):
    id: uuid.UUID
    name: str
    address: str
    private_address: str | None
    labels: dict[str, str]
    last_seen_at: datetime.datetime
    created_at: datetime.datetime


class Directive(msgspec.Struct, frozen=True):
    """What an agent must do with one of its attempts: keep going, or stop within the grace period."""

    attempt_id: uuid.UUID
    action: Literal["continue", "stop"]
    reason: str | None = None
    deadline: datetime.datetime | None = None


class HeartbeatReply(msgspec.Struct, frozen=True):
    lease_expires_at: datetime.datetime
    heartbeat_seconds: float
    directives: list[Directive]


# A claim's client key (a fresh random key per claim, the same on every retry of it): a retried claim whose
# first reply was lost gets the same attempt again, and a heartbeat names the claim it has in flight.
ClaimKey = Annotated[str, msgspec.Meta(min_length=16, max_length=64, pattern="^[A-Za-z0-9_-]+$")]


class ClaimRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    wait_seconds: Annotated[float, msgspec.Meta(ge=0.0, le=600.0)] = 0.0
    kinds: Annotated[list[JobKind], msgspec.Meta(max_length=16)] | None = None
    claim_key: ClaimKey | None = None


class Assignment(msgspec.Struct, frozen=True):
    job_id: uuid.UUID
    attempt_id: uuid.UUID
    experiment_id: uuid.UUID
    kind: JobKind
    arm: ArmName | None
    role: Role | None
    spec: dict[str, Any]  # the kind's spec (JobSpec), untagged, with the serving token of a serving job
    number: int
    rank: int
    world_size: int
    master_addr: str | None
    master_port: int | None
    lease_token: str
    lease_expires_at: datetime.datetime


class ClaimReply(msgspec.Struct, frozen=True):
    assignment: Assignment | None
    heartbeat_seconds: float


# Uploads ---------------------------------------------------------------------------------------


class LeaseProof(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lease_token: Annotated[str, msgspec.Meta(min_length=16, max_length=128)]


class Event(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
    body: dict[str, Any] = {}
    at: Moment | None = None


class EventBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lease_token: Annotated[str, msgspec.Meta(min_length=16, max_length=128)]
    sequence: Count
    events: Annotated[list[Event], msgspec.Meta(min_length=1, max_length=10_000)]


class EventBatchReply(msgspec.Struct, frozen=True):
    attempt_id: uuid.UUID
    sequence: int
    accepted: int


class ServingPhase(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One serving benchmark phase's report (serving/PHASE.json of the bundle)."""

    phase: ServingPhaseName
    report: dict[str, Any]


class AttemptResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lease_token: Annotated[str, msgspec.Meta(min_length=16, max_length=128)]
    outcome: Outcome
    exit_code: Int32 | None = None
    reason: Text | None = None
    # With a succeeded outcome, the job kind's result (JobResult), untagged: the coordinator decodes it as its job's.
    result: dict[str, Any] = {}
    # Measurements, kept whatever the outcome: a train rank's step journal and resource samples.
    journal: list[StepRecord] = []
    resource_samples: list[ResourceSample] = []
    # With a succeeded outcome only: an evaluate job's answers, a serve/benchmark job's phases, and the
    # evidence files this attempt wrote (path in the bundle -> sha256 of a blob uploaded beforehand).
    answers: list[Answer] = []
    serving: list[ServingPhase] = []
    evidence: dict[BundlePath, Sha256] = {}


class RecordedEvent(msgspec.Struct, frozen=True):
    id: uuid.UUID
    experiment_id: uuid.UUID | None
    job_id: uuid.UUID | None
    attempt_id: uuid.UUID | None
    sequence: int | None
    kind: str
    at: datetime.datetime
    body: dict[str, Any]


class HeartbeatRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # The attempts this agent holds: only these leases are renewed, and the reply says, for each, whether to
    # go on. An active attempt of the agent that is named neither here nor by ``claiming`` ends lost.
    attempt_ids: Annotated[list[uuid.UUID], msgspec.Meta(max_length=64)] = []
    # The key of the claim this agent has in flight, whose reply it has not yet read.
    claiming: ClaimKey | None = None


# Reads -----------------------------------------------------------------------------------------


# Pages: a listing's rows in a stable order, ``limit`` at a time; ``next`` is the cursor to pass as ``after=`` for the
# rows that follow (None on the last page). Rows recorded later, as a running attempt's measurements, come after.


class StepMeasurement(msgspec.Struct, frozen=True, tag_field="kind", tag="step"):
    """One update of a train rank's step journal, recorded as the rank reported it (``at``: when it did)."""

    attempt_id: uuid.UUID
    number: int
    rank: int
    step: int
    at: datetime.datetime
    record: StepRecord


class ResourceMeasurement(msgspec.Struct, frozen=True, tag_field="kind", tag="resources"):
    """One resource sample of a train rank's process, ``index`` in its attempt, taken during update ``step``
    (None for a sample only its attempt's result carried)."""

    attempt_id: uuid.UUID
    number: int
    rank: int
    index: int
    step: int | None
    at: datetime.datetime
    sample: ResourceSample


Measurement = StepMeasurement | ResourceMeasurement


class MeasurementPage(msgspec.Struct, frozen=True):
    """Measurements in the order they were recorded."""

    items: list[Measurement]
    next: str | None


class EventPage(msgspec.Struct, frozen=True):
    """An attempt's events in the order they were recorded."""

    items: list[RecordedEvent]
    next: str | None


class RecordedAnswer(msgspec.Struct, frozen=True):
    experiment_id: uuid.UUID
    attempt_id: uuid.UUID
    arm: ArmName
    role: Role
    answer: Answer


class AnswerPage(msgspec.Struct, frozen=True):
    """Answers in arm, role and task order; ``total`` counts every answer the filters match, ``offset`` is the
    first item's place among them."""

    items: list[RecordedAnswer]
    total: int
    limit: int
    offset: int
    next: str | None


class ServingResult(msgspec.Struct, frozen=True):
    id: uuid.UUID
    experiment_id: uuid.UUID
    attempt_id: uuid.UUID
    phase: ServingPhaseName
    report: dict[str, Any]
    created_at: datetime.datetime


# Blobs and evidence ----------------------------------------------------------------------------


class Blob(msgspec.Struct, frozen=True):
    """A stored blob, named by the sha256 of its content: the coordinator keeps one copy of each content however
    often it is sent, so ``created`` is False where the blob was already stored (an upload is idempotent, and an
    agent resends what it cannot tell arrived)."""

    sha256: str
    size: int
    media_type: str
    created: bool


class EvidenceFile(msgspec.Struct, frozen=True):
    path: str
    sha256: str
    size: int
    attempt_id: uuid.UUID | None


class EvidenceAttach(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Evidence the operator wrote (selection.json, the seed's files): path in the bundle -> blob sha256."""

    files: Annotated[dict[BundlePath, Sha256], msgspec.Meta(min_length=1)]
