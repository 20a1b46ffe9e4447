"""Evaluation: greedy generation in left-padded batches, strict checks, retention losses, role gating.

Answers are appended to a partial file as they are made; a restart must reproduce every answer already
recorded, exactly, before it may add more. The summary file is written once, at the end."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch

from experiment.core import layout, tasks
from experiment.core.canonical import canonical_bytes, read_json, sha256_file, write_new_bytes, write_new_json
from experiment.core.errors import CoopError
from experiment.core.plan import Plan
from experiment.core.progress import Emit
from experiment.learning.corpus import IGNORE, Prepared, Probe, TaskItem, load_prepared, seed_snapshot
from experiment.learning.records import Answer, Candidate
from experiment.learning.selection import candidate_for, read_selection, same_model, selection_identity
from experiment.seed import seedmodel

Role = Literal["dev", "test"]
BATCH_SIZE = 16


def batch_size_for(device: str) -> int:
    """Padded batches pay off on a GPU; on a CPU a batch runs to its longest answer, and one prompt at a time
    is about twice as fast with identical output ids (bench/evaluate.py, bench/results/evaluate-cpu.json)."""
    return BATCH_SIZE if device == "cuda" else 1


class Generation(msgspec.Struct, frozen=True):
    output_ids: list[int]  # the generated tokens, through the first EOS when there is one
    ended_with_eos: bool
    hit_token_limit: bool


class RetentionScore(msgspec.Struct, frozen=True):
    id: str
    targets: int
    mean_nats: float


class Summary(msgspec.Struct, frozen=True):
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


@torch.no_grad()
def generate(
    model: torch.nn.Module, prompts: Sequence[list[int]], eos_id: int, pad_id: int, max_new_tokens: int
) -> list[Generation]:
    """Greedy decoding of a batch of prompts, left-padded with an attention mask."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    device = next(model.parameters()).device
    generate_fn: Any = getattr(model, "generate")  # noqa: B009 (a transformers model)
    sequences = generate_fn(
        input_ids=input_ids.to(device),
        attention_mask=mask.to(device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    results = []
    for row in sequences[:, width:].tolist():
        if eos_id in row:
            kept = row[: row.index(eos_id) + 1]
            results.append(Generation(output_ids=kept, ended_with_eos=True, hit_token_limit=False))
        else:
            results.append(Generation(output_ids=row, ended_with_eos=False, hit_token_limit=len(row) >= max_new_tokens))
    return results


def answer_text(tokenizer: Any, generation: Generation) -> str:
    """The text the checker sees: every generated token but the terminating EOS, special tokens included."""
    ids = generation.output_ids[:-1] if generation.ended_with_eos else generation.output_ids
    return str(tokenizer.decode(ids, skip_special_tokens=False))


@torch.no_grad()
def retention_score(model: torch.nn.Module, probe: Probe) -> RetentionScore:
    """Mean nats per answer token of one retention probe."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([probe.input_ids], device=device)).logits[0, :-1].float()
    labels = torch.tensor(probe.labels[1:], device=device)
    total = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    return RetentionScore(id=probe.id, targets=probe.targets, mean_nats=float(total) / probe.targets)


def evaluation_dir(home: Path, role: str, arm: str) -> Path:
    return home / layout.evaluation(role, arm)


def _answers_of(items: list[TaskItem], generations: list[Generation], tokenizer: Any, seconds: float) -> list[Answer]:
    answers = []
    for item, generation in zip(items, generations, strict=True):
        text = answer_text(tokenizer, generation)
        answers.append(
            Answer(
                id=item.id,
                index=item.index,
                family=item.family,
                variant=item.variant,
                input_dependent=item.input_dependent,
                prompt_ids=item.prompt_ids,
                output_ids=generation.output_ids,
                text=text,
                seconds=seconds / len(items),
                ended_with_eos=generation.ended_with_eos,
                hit_token_limit=generation.hit_token_limit,
                check=tasks.check(text, item.expected),
            )
        )
    return answers


def _same_answer(recorded: Answer, fresh: Answer) -> bool:
    return msgspec.structs.replace(recorded, seconds=0.0) == msgspec.structs.replace(fresh, seconds=0.0)


def _gate(
    prepared: Prepared, arm: str, role: Role, selection_path: Path | None, seed_dir: Path
) -> tuple[Candidate, str | None]:
    """The model to evaluate; a test evaluation needs a selection committed for these inputs and this arm."""
    if role == "dev":
        return candidate_for(prepared, arm, seed_dir), None
    if selection_path is None:
        raise CoopError("a test evaluation needs --selection: run coop select first and commit its selection")
    selection = read_selection(selection_path)
    if selection.prepared_identity != prepared.identity:
        raise CoopError(
            f"selection {selection_path} is for prepared inputs {selection.prepared_identity[:16]}, "
            f"this home holds {prepared.identity[:16]}"
        )
    selected = selection.arms.get(arm)
    if selected is None:
        raise CoopError(f"selection {selection_path} has no candidate for arm {arm}")
    present = candidate_for(prepared, arm, seed_dir)
    if not same_model(present, selected):
        raise CoopError(f"arm {arm}'s candidate on this host is not the one selection {selection_path} names")
    return present, selection_identity(selection)


@dataclass(frozen=True)
class _Answerer:
    """The model that answers, with everything its greedy generation is fixed by."""

    model: torch.nn.Module
    tokenizer: Any
    eos_id: int
    pad_id: int
    max_new_tokens: int
    batch_size: int

    def answer(self, batch: list[TaskItem]) -> list[Answer]:
        began = time.monotonic()
        generations = generate(self.model, [i.prompt_ids for i in batch], self.eos_id, self.pad_id, self.max_new_tokens)
        return _answers_of(batch, generations, self.tokenizer, time.monotonic() - began)


def _answerer(home: Path, model_dir: Path, plan: Plan, candidate: Candidate, batch_size: int) -> _Answerer:
    """The candidate loaded on the plan's device, deterministic, after the seed it grew from is verified."""
    seedmodel.verify_seed(model_dir, seed_snapshot(plan))
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(plan.runtime.cpu_threads)
    tokenizer = seedmodel.load_tokenizer(model_dir)
    model = seedmodel.load_model(model_dir if candidate.path is None else home / candidate.path)
    device = torch.device("cuda") if plan.runtime.device == "cuda" else torch.device("cpu")
    model.to(device).eval()
    return _Answerer(
        model=model,
        tokenizer=tokenizer,
        eos_id=int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token)),
        pad_id=int(tokenizer.pad_token_id),
        max_new_tokens=plan.evaluation.max_new_tokens,
        batch_size=batch_size,
    )


def _keep(fresh: list[Answer], recorded: list[Answer], recorded_path: Path, answers: list[Answer]) -> None:
    """Add fresh answers to ``answers``: where the file already records one, the fresh one must reproduce it
    and the recorded one is kept; past them, each is appended to the file."""
    for answer in fresh:
        position = len(answers)
        if position < len(recorded):
            if not _same_answer(recorded[position], answer):
                raise CoopError(
                    f"the restarted evaluation does not reproduce the recorded answer to task "
                    f"{answer.id} ({recorded_path}, line {position + 1}); it refuses to continue"
                )
            answers.append(recorded[position])
            continue
        with recorded_path.open("ab") as handle:
            handle.write(canonical_bytes(msgspec.to_builtins(answer)) + b"\n")
        answers.append(answer)


def _answer_all(
    answerer: _Answerer, items: list[TaskItem], out: Path, arm: str, role: Role, emit: Emit, stop_after: int | None
) -> list[Answer] | None:
    """Every item answered in batches, as the answers file records them; None when ``stop_after`` ended it."""
    recorded_path = out / "answers.jsonl"
    recorded = (
        [msgspec.json.decode(line, type=Answer) for line in recorded_path.read_bytes().splitlines()]
        if recorded_path.exists()
        else []
    )
    emit({"event": "evaluation-started", "arm": arm, "role": role, "items": len(items), "recorded": len(recorded)})
    out.mkdir(parents=True, exist_ok=True)
    answers: list[Answer] = []
    for start in range(0, len(items), answerer.batch_size):
        fresh = answerer.answer(items[start : start + answerer.batch_size])
        _keep(fresh, recorded, recorded_path, answers)
        emit(
            {
                "event": "evaluate",
                "arm": arm,
                "role": role,
                "done": len(answers),
                "total": len(items),
                "correct": sum(a.check.correct for a in answers),
            }
        )
        if stop_after is not None and len(answers) >= stop_after:
            return None
    return answers


def _retention(model: torch.nn.Module, probes: list[Probe], out: Path) -> list[RetentionScore]:
    """Every retention probe's score, written to the retention file."""
    scores = [retention_score(model, probe) for probe in probes]
    write_new_bytes(out / "retention.jsonl", b"".join(canonical_bytes(msgspec.to_builtins(s)) + b"\n" for s in scores))
    return scores


def evaluate(
    home: Path,
    model_dir: Path,
    arm: str,
    role: Role,
    selection_path: Path | None,
    emit: Emit,
    stop_after: int | None = None,
    batch_size: int | None = None,
) -> Summary | None:
    """Answer every task of ``role``; ``batch_size`` defaults to the device's faster choice (batch_size_for)."""
    prepared = load_prepared(home)
    batch_size = batch_size or batch_size_for(prepared.plan.runtime.device)
    candidate, selection_identity = _gate(prepared, arm, role, selection_path, model_dir)
    out = evaluation_dir(home, role, arm)
    if (out / "evaluation.json").exists():
        # A finished evaluation whose attempt was lost before it reported: report it again, files unchanged.
        summary = _finished(out, prepared.identity, candidate, selection_identity)
        _emit_evaluated(summary, out, emit)
        return summary
    answerer = _answerer(home, model_dir, prepared.plan, candidate, batch_size)
    answers = _answer_all(answerer, prepared.task_items(role), out, arm, role, emit, stop_after)
    if answers is None:
        return None
    scores = _retention(answerer.model, prepared.probes(), out)
    summary = Summary(
        arm=arm,
        role=role,
        prepared_identity=prepared.identity,
        candidate=candidate,
        selection_identity=selection_identity,
        max_new_tokens=answerer.max_new_tokens,
        batch_size=batch_size,
        answers=len(answers),
        correct=sum(a.check.correct for a in answers),
        answers_sha256=sha256_file(out / "answers.jsonl"),
        retention_sha256=sha256_file(out / "retention.jsonl"),
        retention_mean_nats=sum(s.mean_nats for s in scores) / len(scores) if scores else 0.0,
    )
    write_new_json(out / "evaluation.json", msgspec.to_builtins(summary))
    _emit_evaluated(summary, out, emit)
    return summary


def _finished(out: Path, prepared_identity: str, candidate: Candidate, selection_identity: str | None) -> Summary:
    """The finished evaluation in ``out``, its files checked by hash; refused if it answered another question."""
    summary, _, _ = read_answers(out)
    if (summary.prepared_identity, summary.candidate, summary.selection_identity) != (
        prepared_identity,
        candidate,
        selection_identity,
    ):
        raise CoopError(
            f"{out} already holds a finished evaluation of other inputs, model or selection; it is never overwritten"
        )
    return summary


def _emit_evaluated(summary: Summary, out: Path, emit: Emit) -> None:
    emit(
        {
            "event": "evaluated",
            "arm": summary.arm,
            "role": summary.role,
            "answers": summary.answers,
            "correct": summary.correct,
            "accuracy": round(summary.correct / summary.answers, 4),
            "retention_mean_nats": summary.retention_mean_nats,
            "evaluation": str(out / "evaluation.json"),
        }
    )


def read_answers(folder: Path) -> tuple[Summary, list[Answer], list[RetentionScore]]:
    """A finished evaluation: its summary, answers and retention scores, each file checked by its hash."""
    summary = msgspec.convert(read_json(folder / "evaluation.json"), type=Summary)
    answers_path = folder / "answers.jsonl"
    retention_path = folder / "retention.jsonl"
    if sha256_file(answers_path) != summary.answers_sha256:
        raise CoopError(f"{answers_path} does not match the sha256 in {folder / 'evaluation.json'}")
    if sha256_file(retention_path) != summary.retention_sha256:
        raise CoopError(f"{retention_path} does not match the sha256 in {folder / 'evaluation.json'}")
    answers = [msgspec.json.decode(line, type=Answer) for line in answers_path.read_bytes().splitlines()]
    scores = [msgspec.json.decode(line, type=RetentionScore) for line in retention_path.read_bytes().splitlines()]
    return summary, answers, scores
