"""The report's serving section: the three benchmark phases checked and compared (docs/evidence.md).

Checks: each phase is for these inputs and served only the selected clean-pair model; every completion is the
answer the dev evaluation of that checkpoint gave (agreement.refusal, the probe's own rule: the same output ids on
CPU; on GPU the strict-check outcomes, one in 16 excepted, with the id agreement stated), none is padding or one
repeated token, and its correctness is the strict checker's; no measured request was answered from the probe's
retry cache; no request was lost; every task got the same output tokens in every phase; and the failure phase saw
the stopped replica (a first attempt failed and was retried, or the client went on without it: requests kept
starting on the other replica after its last). The benchmark holds new requests from the stop's announcement until
it sees a replica leave, so the second holds however fast the rest of the workload goes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from experiment.core import tasks
from experiment.core.layout import SERVING, evaluation, serving_phase
from experiment.learning.answers import Generation, answer_text
from experiment.learning.corpus import Prepared, TaskItem
from experiment.learning.records import Answer
from experiment.report.model import Serving, ServingFailure, ServingReference
from experiment.seed.seedtokenizer import SeedTokenizer
from experiment.serving import agreement
from experiment.serving.servingrecord import PHASES, PhaseResult

Require = Callable[[bool, Path | str, str, str], None]


def _served_answers(
    path: Path, record: PhaseResult, items: dict[str, TaskItem], tokenizer: SeedTokenizer, require: Require
) -> list[agreement.ServedAnswer]:
    """Every completion of a phase, re-decoded and re-checked by the strict checker; padding or one repeated token
    is refused outright."""
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    served = []
    for number, completion in enumerate(record.completions):
        where = f"completions[{number}]"
        item = items.get(completion.task_id)
        require(item is not None, path, f"{where}.task_id", "is not a prepared dev task")
        assert item is not None
        ids = completion.output_ids
        broken = agreement.degenerate(ids, eos, pad)
        require(broken is None, path, f"{where}.output_ids", f"task {item.id}: {broken}; no model answers that")
        # The probe cut the ids at the first EOS, as the evaluation does; its reading of them is the evaluation's.
        generation = Generation(output_ids=ids, ended_with_eos=ids[-1:] == [eos], hit_token_limit=False)
        text = answer_text(tokenizer, generation)
        check = tasks.check(text, item.expected)
        require(completion.correct == check.correct, path, f"{where}.correct", "is not the strict checker's outcome")
        served.append(agreement.ServedAnswer(task_id=item.id, output_ids=ids, text=text, check=check))
    return served


def _phase_record(path: Path, phase: str, require: Require) -> PhaseResult:
    require(path.is_file(), path, SERVING, "is missing (the serving commitment promises all three phases)")
    try:
        record = msgspec.json.decode(path.read_bytes(), type=PhaseResult)
    except msgspec.DecodeError as exc:
        require(False, path, SERVING, f"is not a benchmark phase record: {exc}")
        raise
    require(record.phase == phase, path, "phase", f"is not {phase}")
    return record


def _check_phase(
    path: Path, record: PhaseResult, prepared: Prepared, served_identity: str, workload: list[str], require: Require
) -> None:
    require(record.prepared_identity == prepared.identity, path, "prepared_identity", "differs")
    numerics = prepared.plan.evaluation.numerics
    require(record.workload.numerics == numerics, path, "workload.numerics", f"is not the plan's {numerics}")
    served_arm = prepared.plan.served_arm()
    require(record.models == [served_identity], path, "models", f"must be only the {served_arm} selection")
    metrics = record.metrics
    require(metrics.cache_hits == 0, path, "metrics.cache_hits", "a measured request came from the cache")
    require(not any(c.cached for c in record.completions), path, "completions.cached", "must all be false")
    require(metrics.failed == 0, path, "metrics.failed", "requests were lost")
    require(len(record.completions) == metrics.requests, path, "completions", "must answer every request")
    require(
        sorted(c.task_id for c in record.completions) == sorted(workload),
        path,
        "completions.task_id",
        "are not the plan's workload (the first dev tasks), each once",
    )


def section(
    bundle: Path,
    prepared: Prepared,
    served_identity: str,
    reference: list[Answer],
    dev: list[TaskItem],
    tokenizer: SeedTokenizer,
    require: Require,
) -> Serving:
    """``reference``: the served checkpoint's dev evaluation, already checked against the dev tasks."""
    truth = {answer.id: answer for answer in reference}
    items = {item.id: item for item in dev}
    device = prepared.plan.runtime.device
    reference_folder = evaluation("dev", prepared.plan.served_arm())
    workload = [item.id for item in dev[: prepared.plan.serving.workload_tasks]]
    agreements: dict[str, agreement.Agreement] = {}
    records: dict[str, PhaseResult] = {}
    for phase in PHASES:
        path = bundle / serving_phase(phase)
        record = _phase_record(path, phase, require)
        _check_phase(path, record, prepared, served_identity, workload, require)
        served = _served_answers(path, record, items, tokenizer, require)
        agreements[phase] = _agreement(path, record, truth, served, device, reference_folder, require)
        records[phase] = record
    _check_same_outputs(bundle, records, require)
    failure = records["failure"]
    after_stop = _check_stop_seen(bundle, failure, require)
    single, pair = records["single"].metrics, records["pair"].metrics
    return Serving(
        phases={phase: records[phase].metrics for phase in PHASES},
        reference=ServingReference(
            evaluation=reference_folder,
            device=device,
            tasks=len(workload),
            correct=sum(truth[task].check.correct for task in workload),
        ),
        agreement=agreements,
        pair_over_single_request_throughput=pair.request_throughput / single.request_throughput,
        failure=ServingFailure(
            stopped_after_completions=failure.stop_after,
            stop_seen_at_seconds=failure.stop_seen,
            requests_started_after_one_replica_left=after_stop,
            first_attempt_failures=failure.metrics.first_attempt_failures,
            retries=failure.metrics.retries,
            lost=failure.metrics.failed,
        ),
        failed_attempt_seconds={
            phase: round(sum(a.ended - a.started for a in record.attempts if a.status != 200), 3)
            for phase, record in records.items()
        },
    )


def _agreement(
    path: Path,
    record: PhaseResult,
    truth: dict[str, Answer],
    served: list[agreement.ServedAnswer],
    device: str,
    reference_folder: str,
    require: Require,
) -> agreement.Agreement:
    """How a phase's completions agree with the reference evaluation; refused where they are not its answers."""
    found = agreement.compare(truth, served)
    require(record.metrics.correct == found.correct, path, "metrics.correct", "is not the strict checker's count")
    refused = agreement.refusal(truth, served, device)
    where = f"{reference_folder}/answers.jsonl"
    require(refused is None, path, "completions.output_ids", f"are not the answers of {where}: {refused}")
    return found


def _check_same_outputs(bundle: Path, records: dict[str, PhaseResult], require: Require) -> None:
    """Every task got the same output tokens in every phase as in the first (the single replica)."""
    outputs = {phase: {c.task_id: c.output_ids for c in r.completions} for phase, r in records.items()}
    for phase in PHASES[1:]:
        path = bundle / serving_phase(phase)
        require(outputs[phase] == outputs[PHASES[0]], path, "completions.output_ids", "differ from the single phase")


def _check_stop_seen(bundle: Path, failure: PhaseResult, require: Require) -> int:
    """The failure phase saw the stopped replica; the requests it started after that replica's last."""
    after_stop = _served_without_one(failure)
    require(
        failure.metrics.first_attempt_failures >= 1 or after_stop >= 2 * failure.workload.concurrency,
        bundle / serving_phase("failure"),
        "attempts",
        "the failure phase never saw the stopped replica (no failed attempt, no requests served without it)",
    )
    return after_stop


def _served_without_one(record: PhaseResult) -> int:
    """Attempts started after the last one sent to the endpoint that left first: a replica stopped gracefully
    finishes what it holds and the health-aware client stops sending to it, so no attempt need fail."""
    last: dict[str | None, float] = {}
    for attempt in record.attempts:
        last[attempt.endpoint] = max(last.get(attempt.endpoint, 0.0), attempt.started)
    if len(last) < 2:
        return 0
    left = min(last.values())
    return sum(1 for attempt in record.attempts if attempt.started > left)
