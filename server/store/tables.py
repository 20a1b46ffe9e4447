"""Answers and measurements as CSV, for analysts' tools: one row each, the same rows as the JSON listings."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Iterator, Mapping, Sequence

from experiment import wire

ANSWER_COLUMNS = (
    "experiment_id",
    "attempt_id",
    "arm",
    "role",
    "task_id",
    "index",
    "family",
    "variant",
    "input_dependent",
    "correct",
    "valid_json_object",
    "reason",
    "hit_token_limit",
    "ended_with_eos",
    "output_tokens",
    "seconds",
    "text",
)
# A step record's and a resource sample's fields side by side: a row fills its kind's (the sample's seconds since
# its sampler started are sample_seconds, apart from the update's own seconds; a GPU rank's memory is flattened).
STEP_COLUMNS = tuple(
    name for name in wire.StepRecord.__struct_fields__ if name not in {"step", "positions", "local_positions"}
)
SAMPLE_COLUMNS = (
    "sample_seconds",
    "rss_bytes",
    "cpu_user_seconds",
    "cpu_system_seconds",
    "threads",
    "gpu_allocated_bytes",
    "preflight_bytes",
)
MEASUREMENT_COLUMNS = ("attempt_id", "number", "rank", "kind", "step", "index", "at", *STEP_COLUMNS, *SAMPLE_COLUMNS)


def _lines(columns: Sequence[str], rows: Iterable[Mapping[str, object]]) -> Iterator[str]:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
        yield buffer.getvalue()
        buffer.seek(0)
        buffer.truncate()
    yield buffer.getvalue()


def answers(items: Iterable[wire.RecordedAnswer]) -> Iterator[str]:
    return _lines(
        ANSWER_COLUMNS,
        (
            {
                "experiment_id": item.experiment_id,
                "attempt_id": item.attempt_id,
                "arm": item.arm,
                "role": item.role,
                "task_id": item.answer.id,
                "index": item.answer.index,
                "family": item.answer.family,
                "variant": item.answer.variant,
                "input_dependent": item.answer.input_dependent,
                "correct": item.answer.check.correct,
                "valid_json_object": item.answer.check.valid_json_object,
                "reason": item.answer.check.reason,
                "hit_token_limit": item.answer.hit_token_limit,
                "ended_with_eos": item.answer.ended_with_eos,
                "output_tokens": len(item.answer.output_ids),
                "seconds": item.answer.seconds,
                "text": item.answer.text,
            }
            for item in items
        ),
    )


def _measurement(item: wire.Measurement) -> dict[str, object]:
    row: dict[str, object] = {
        "attempt_id": item.attempt_id,
        "number": item.number,
        "rank": item.rank,
        "step": item.step,
        "at": item.at.isoformat(),
    }
    if isinstance(item, wire.StepMeasurement):
        return row | {"kind": "step"} | {name: getattr(item.record, name) for name in STEP_COLUMNS}
    taken, gpu = item.sample, item.sample.gpu
    sample = {
        "sample_seconds": taken.seconds,
        "rss_bytes": taken.rss_bytes,
        "cpu_user_seconds": taken.cpu_user_seconds,
        "cpu_system_seconds": taken.cpu_system_seconds,
        "threads": taken.threads,
        "gpu_allocated_bytes": None if gpu is None else gpu.allocated_bytes,
        "preflight_bytes": None if gpu is None else gpu.preflight_bytes,
    }
    return row | {"kind": "resources", "index": item.index} | sample


def measurements(items: Iterable[wire.Measurement]) -> Iterator[str]:
    return _lines(MEASUREMENT_COLUMNS, (_measurement(item) for item in items))
