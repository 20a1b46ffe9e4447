"""Evaluation: greedy answers (experiment.learning.decoding), strict checks, retention losses, role gating.

Answers are appended to a partial file as they are made; a restart must reproduce every answer already
recorded, exactly, before it may add more. The summary file is written once, at the end."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import torch

from experiment.core import determinism, tasks
from experiment.core.canonical import canonical_bytes, sha256_file, write_new_bytes, write_new_json
from experiment.core.errors import CoopError
from experiment.core.plan import Numerics, Plan
from experiment.core.progress import Emit
from experiment.learning.answers import Generation, answer_text, evaluation_dir, read_answers
from experiment.learning.corpus import IGNORE, Prepared, Probe, TaskItem, load_prepared, seed_snapshot
from experiment.learning.decoding import generate
from experiment.learning.events import EvaluatedEvent
from experiment.learning.records import Answer, Candidate, RetentionScore, Summary
from experiment.learning.selection import candidate_for, read_selection, same_model, selection_identity
from experiment.seed import seedmodel
from experiment.seed.llama import Llama
from experiment.seed.seedfiles import verify_seed
from experiment.seed.seedtokenizer import SeedTokenizer, read_tokenizer

Role = Literal["dev", "test"]
CPU_BATCH_SIZE = 128
CUDA_BATCH_SIZE = 16
CHUNK_BATCHES = 4  # the evaluation's items go to generate CHUNK_BATCHES batches at a time, to sort by length


# The plan's evaluation numerics as the dtype the answering model's weights and activations are in.
NUMERICS_DTYPE: dict[Numerics, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def batch_size_for(device: str) -> int:
    """The prompts decoded together. On a CPU, 128: the committed seed answers the local plan's 256 test prompts
    several times as fast as transformers' generate does one prompt at a time, with identical output ids, and
    faster than in batches of 32 or 64 (bench/evaluate.py, bench/results/evaluate-cpu.json). On a GPU, 16, a size
    no GPU has measured with this decoding."""
    return CUDA_BATCH_SIZE if device == "cuda" else CPU_BATCH_SIZE


@torch.no_grad()
def retention_score(model: torch.nn.Module, probe: Probe) -> RetentionScore:
    """Mean nats per answer token of one retention probe: the logits in the model's dtype (the plan's numerics),
    the cross-entropy over them in float32."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([probe.input_ids], device=device))[0, :-1].float()
    labels = torch.tensor(probe.labels[1:], device=device)
    total = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    return RetentionScore(id=probe.id, targets=probe.targets, mean_nats=float(total) / probe.targets)


def answers_of(
    items: list[TaskItem], generations: list[Generation], tokenizer: SeedTokenizer, seconds: float
) -> list[Answer]:
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

    model: Llama
    tokenizer: SeedTokenizer
    eos_id: int
    pad_id: int
    max_new_tokens: int
    numerics: Numerics
    batch_size: int

    def answer(self, chunk: list[TaskItem]) -> list[Answer]:
        """The chunk's answers, in its order, made in batches of similar prompt lengths."""
        began = time.monotonic()
        prompts = [i.prompt_ids for i in chunk]
        generations = generate(self.model, prompts, self.eos_id, self.pad_id, self.max_new_tokens, self.batch_size)
        return answers_of(chunk, generations, self.tokenizer, time.monotonic() - began)


def _answerer(home: Path, model_dir: Path, plan: Plan, candidate: Candidate, batch_size: int) -> _Answerer:
    """The candidate loaded on the plan's device, deterministic, after the seed it grew from is verified."""
    verify_seed(model_dir, seed_snapshot(plan))
    determinism.make_deterministic(plan.runtime.device, plan.runtime.cpu_threads)
    tokenizer = read_tokenizer(model_dir)
    model = seedmodel.load_model(model_dir if candidate.path is None else home / candidate.path)
    return _Answerer(
        model=answering_model(model, plan.runtime.device, plan.evaluation.numerics),
        tokenizer=tokenizer,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        max_new_tokens=plan.evaluation.max_new_tokens,
        numerics=plan.evaluation.numerics,
        batch_size=batch_size,
    )


def answering_model(model: Llama, device: str, numerics: Numerics) -> Llama:
    """``model`` on ``device``, its weights (and so every activation) in the plan's numerics, for inference: the
    numbers a replica of the same checkpoint serves in (replica.ReplicaSpec.dtype)."""
    return model.to(device=torch.device(device), dtype=NUMERICS_DTYPE[numerics]).eval()


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
    """Every item answered, a chunk of CHUNK_BATCHES batches at a time, as the answers file records them; None when
    ``stop_after`` ended it (after the chunk that reached it)."""
    recorded_path = out / "answers.jsonl"
    recorded = (
        [msgspec.json.decode(line, type=Answer) for line in recorded_path.read_bytes().splitlines()]
        if recorded_path.exists()
        else []
    )
    emit({"event": "evaluation-started", "arm": arm, "role": role, "items": len(items), "recorded": len(recorded)})
    out.mkdir(parents=True, exist_ok=True)
    answers: list[Answer] = []
    chunk = answerer.batch_size * CHUNK_BATCHES
    for start in range(0, len(items), chunk):
        fresh = answerer.answer(items[start : start + chunk])
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
        numerics=answerer.numerics,
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
    evaluated = EvaluatedEvent(
        arm=summary.arm,
        role=summary.role,
        answers=summary.answers,
        correct=summary.correct,
        accuracy=round(summary.correct / summary.answers, 4),
        retention_mean_nats=summary.retention_mean_nats,
        evaluation=str(out / "evaluation.json"),
    )
    emit(msgspec.to_builtins(evaluated))
