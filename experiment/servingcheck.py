"""The report's serving section: the three benchmark phases checked and compared (docs/evidence.md).

Checks: each phase is for these inputs and served only the selected clean-pair model; every completion is the
answer the dev evaluation of that checkpoint gave (the same output ids on CPU; on GPU at least 95% of the
strict-check outcomes, with the id agreement stated), none is padding or one repeated token, and its correctness
is the strict checker's; no measured request was answered from the probe's retry cache; no request was lost;
every task got the same output tokens in every phase; and the failure phase saw the stopped replica (a first
attempt failed and was retried, or the client went on without it: requests kept starting on the other replica
after its last). The benchmark holds new requests from the stop's announcement until it sees a replica leave, so
the second holds however fast the rest of the workload goes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from experiment import agreement, tasks
from experiment.canonical import read_json
from experiment.corpus import Prepared, TaskItem
from experiment.evaluation import Answer, Generation, answer_text
from experiment.layout import evaluation
from experiment.servingrecord import PHASES

SERVED = "clean-pair"
GPU_MIN_SAME_OUTCOME = 0.95  # GPU kernels may round differently from the evaluation's; outcomes must still agree
Require = Callable[[bool, Path | str, str, str], None]


def _served_answers(
    path: Path, report: dict[str, Any], items: dict[str, TaskItem], tokenizer: Any, require: Require
) -> list[agreement.ServedAnswer]:
    """Every completion of a phase, re-decoded and re-checked by the strict checker; padding or one repeated token
    is refused outright."""
    eos = int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
    pad = int(tokenizer.pad_token_id)
    served = []
    for number, completion in enumerate(report["completions"]):
        where = f"completions[{number}]"
        item = items.get(completion["task_id"])
        require(item is not None, path, f"{where}.task_id", "is not a prepared dev task")
        assert item is not None
        ids = [int(token) for token in completion["output_ids"]]
        broken = agreement.degenerate(ids, eos, pad)
        require(broken is None, path, f"{where}.output_ids", f"task {item.id}: {broken}; no model answers that")
        # The probe cut the ids at the first EOS, as the evaluation does; its reading of them is the evaluation's.
        generation = Generation(output_ids=ids, ended_with_eos=ids[-1:] == [eos], hit_token_limit=False)
        check = tasks.check(answer_text(tokenizer, generation), item.expected)
        require(completion["correct"] == check.correct, path, f"{where}.correct", "is not the strict checker's outcome")
        served.append(agreement.ServedAnswer(task_id=item.id, output_ids=ids, check=check))
    return served


def section(
    bundle: Path,
    prepared: Prepared,
    served_identity: str,
    reference: list[Answer],
    dev: list[TaskItem],
    tokenizer: Any,
    require: Require,
) -> dict[str, Any]:
    """``reference``: the served checkpoint's dev evaluation, already checked against the dev tasks."""
    folder = bundle / "serving"
    truth = {answer.id: answer for answer in reference}
    items = {item.id: item for item in dev}
    device = prepared.plan.runtime.device
    workload = [item.id for item in dev[: prepared.plan.serving.workload_tasks]]
    agreements: dict[str, agreement.Agreement] = {}
    reports: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        path = folder / f"{phase}.json"
        require(path.is_file(), path, "serving", "is missing (the serving commitment promises all three phases)")
        report: dict[str, Any] = read_json(path)
        require(report.get("phase") == phase, path, "phase", f"is not {phase}")
        require(report.get("prepared_identity") == prepared.identity, path, "prepared_identity", "differs")
        require(report.get("models") == [served_identity], path, "models", f"must be only the {SERVED} selection")
        metrics = report["metrics"]
        require(metrics["cache_hits"] == 0, path, "metrics.cache_hits", "a measured request came from the cache")
        require(not any(c["cached"] for c in report["completions"]), path, "completions.cached", "must all be false")
        require(metrics["failed"] == 0, path, "metrics.failed", "requests were lost")
        require(len(report["completions"]) == metrics["requests"], path, "completions", "must answer every request")
        require(
            sorted(c["task_id"] for c in report["completions"]) == sorted(workload),
            path,
            "completions.task_id",
            "are not the plan's workload (the first dev tasks), each once",
        )
        served = _served_answers(path, report, items, tokenizer, require)
        found = agreement.compare(truth, served)
        require(metrics["correct"] == found.correct, path, "metrics.correct", "is not the strict checker's count")
        reference_file = f"{evaluation('dev', SERVED)}/answers.jsonl"
        min_outcome = GPU_MIN_SAME_OUTCOME if device != "cpu" else 1.0
        refused = agreement.refusal(found, device, min_outcome)
        require(refused is None, path, "completions.output_ids", f"are not the answers of {reference_file}: {refused}")
        agreements[phase] = found
        reports[phase] = report
    outputs = {phase: {c["task_id"]: c["output_ids"] for c in r["completions"]} for phase, r in reports.items()}
    for phase in PHASES[1:]:
        path = folder / f"{phase}.json"
        require(outputs[phase] == outputs["single"], path, "completions.output_ids", "differ from the single phase")
    failure = reports["failure"]["metrics"]
    after_stop = _served_without_one(reports["failure"])
    concurrency = int(reports["failure"]["workload"]["concurrency"])
    require(
        failure["first_attempt_failures"] >= 1 or after_stop >= 2 * concurrency,
        folder / "failure.json",
        "attempts",
        "the failure phase never saw the stopped replica (no failed attempt, no requests served without it)",
    )
    single, pair = reports["single"]["metrics"], reports["pair"]["metrics"]
    return {
        "phases": {phase: reports[phase]["metrics"] for phase in PHASES},
        "reference": {
            "evaluation": evaluation("dev", SERVED),
            "device": device,
            "tasks": len(workload),
            "correct": sum(truth[task].check.correct for task in workload),
        },
        "agreement": {
            phase: msgspec.to_builtins(found) | {"token_agreement": found.token_agreement}
            for phase, found in agreements.items()
        },
        "pair_over_single_request_throughput": pair["request_throughput"] / single["request_throughput"],
        "failure": {
            "stopped_after_completions": reports["failure"].get("stop_after"),
            "stop_seen_at_seconds": reports["failure"].get("stop_seen"),
            "requests_started_after_one_replica_left": after_stop,
            "first_attempt_failures": failure["first_attempt_failures"],
            "retries": failure["retries"],
            "lost": failure["failed"],
        },
    }


def _served_without_one(report: dict[str, Any]) -> int:
    """Attempts started after the last one sent to the endpoint that left first: a replica stopped gracefully
    finishes what it holds and the health-aware client stops sending to it, so no attempt need fail."""
    last: dict[str, float] = {}
    for attempt in report["attempts"]:
        last[attempt["endpoint"]] = max(last.get(attempt["endpoint"], 0.0), float(attempt["started"]))
    if len(last) < 2:
        return 0
    left = min(last.values())
    return sum(1 for attempt in report["attempts"] if float(attempt["started"]) > left)
