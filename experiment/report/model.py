"""The report's shape: what `coop report` writes as report.json and what the coordinator records, as typed
Structs, defined once. The HTML page, the figures, the CLI and the coordinator read its attributes."""

from __future__ import annotations

import msgspec

from experiment.core.canonical import JsonObject
from experiment.core.errors import CoopError
from experiment.learning.records import NumericalProfile
from experiment.learning.stats import Cell, Paired, Retention, Verdict
from experiment.report.attempts import TrainingFault
from experiment.report.localsgd import LocalSgd
from experiment.serving.agreement import Agreement
from experiment.serving.servingrecord import Metrics


class Accuracy(msgspec.Struct, frozen=True):
    overall: Cell
    by_family: dict[str, Cell]
    by_variant: dict[str, Cell]
    input_dependent: Cell
    valid_json_object: int
    hit_token_limit: int


class Primary(msgspec.Struct, frozen=True):
    """The only pass/fail: the clean single arm against the untouched seed on the test items."""

    comparison: str
    baseline: str
    arm: str
    paired: Paired
    retention: Retention
    verdict: Verdict


class Comparison(msgspec.Struct, frozen=True):
    """A descriptive paired comparison: wins are items ``arm`` answers right and ``baseline`` wrong."""

    baseline: str
    arm: str
    paired: Paired

    @property
    def name(self) -> str:
        return f"{self.arm} vs {self.baseline}"


class Margin(msgspec.Struct, frozen=True):
    """Descriptive: the pair arm's accuracy is no more than ``margin`` below the single clean arm's."""

    arm: str
    baseline: str
    margin: float
    within: bool


class Descriptive(msgspec.Struct, frozen=True):
    comparisons: list[Comparison]
    pair_margin: Margin
    retention: dict[str, Retention]  # per trained arm, against the seed


class ArmTraining(msgspec.Struct, frozen=True):
    """One trained arm's runs, as their result files record them (per-rank lists in rank order)."""

    ranks: int
    parameter_digest: str
    loop_seconds: list[float]
    median_update_seconds: float
    update_seconds: list[float]
    losses: list[float]
    network_bytes_sent: list[int]
    network_scope: str
    peak_memory_bytes: list[int]
    peak_memory_kind: str
    numerical_profile: NumericalProfile
    # A gang whose collectives were pinned to a private interface: the bytes each rank sent on it per update,
    # apart from the whole-host counters, and the all-reduce's theory, 2 (N-1)/N x 4 B x parameters.
    private_interface: str | None = None
    private_bytes_per_update: list[float] | None = None
    allreduce_bytes_per_update: float | None = None
    # What each generation of the arm's job that did not succeed cost (experiment.report.attempts); None: the
    # bundle carries no record of the attempts.
    faults: list[TrainingFault] | None = None
    # What each rank's process wrote during its updates (the sum of its journal's written_bytes: its collectives'
    # socket writes on a CPU gloo gang); None when a journal lacks the count.
    written_bytes: list[int] | None = None


class ServingReference(msgspec.Struct, frozen=True):
    evaluation: str  # the served checkpoint's dev evaluation folder
    device: str
    tasks: int
    correct: int


class ServingFailure(msgspec.Struct, frozen=True):
    stopped_after_completions: int | None
    stop_seen_at_seconds: float | None
    requests_started_after_one_replica_left: int
    first_attempt_failures: int
    retries: int
    lost: int


class Serving(msgspec.Struct, frozen=True):
    phases: dict[str, Metrics]  # in the benchmark's order
    reference: ServingReference
    agreement: dict[str, Agreement]
    pair_over_single_request_throughput: float
    failure: ServingFailure
    # per phase, the seconds its attempts that did not answer took (what a lost replica cost the clients)
    failed_attempt_seconds: dict[str, float] = msgspec.field(default_factory=dict)


class Report(msgspec.Struct, frozen=True):
    plan: str
    plan_identity: str
    prepared_identity: str
    selection_identity: str
    arms: list[str]  # every arm, in the plan's order, the baseline first
    candidates: dict[str, str]  # arm -> the selected model identity
    ledger_entries: int | None  # None: the bundle carries no ledger
    primary: Primary | None  # the reference design's contract; None for a local-SGD plan
    descriptive: Descriptive | None  # the reference design's
    accuracy: dict[str, Accuracy]
    training: dict[str, ArmTraining]
    pair_over_single_median_update: float | None  # the reference design's
    serving: Serving | None
    checks: list[str]
    design: str = "reference"
    local_sgd: LocalSgd | None = None  # the local-SGD design's verdict (experiment.report.localsgd)

    def verdict(self) -> tuple[str, Verdict]:
        """The plan's one verdict and what it judges: the primary contract, or the local-SGD design's criteria."""
        if self.local_sgd is not None:
            test = self.local_sgd.noninferiority
            return (
                f"{test.arm} non-inferior to {test.control} (margin {test.margin:g}), retention",
                self.local_sgd.verdict,
            )
        if self.primary is None:
            raise CoopError(f"the report of plan {self.plan} holds no verdict")
        return self.primary.comparison, self.primary.verdict


def read_report(data: bytes | JsonObject) -> Report:
    """A recorded report (its JSON bytes, or the decoded object the coordinator stores)."""
    if isinstance(data, bytes):
        return msgspec.json.decode(data, type=Report)
    return msgspec.convert(data, type=Report)
