"""An evaluation's answers as files and text: the folder a finished evaluation is in, its files read back and
checked by hash, and the text the checker sees of a generation. What the evaluation writes, and what the probe and
the report read without torch."""

from __future__ import annotations

from pathlib import Path

import msgspec

from experiment.core import layout
from experiment.core.canonical import read_json, sha256_file
from experiment.core.errors import CoopError
from experiment.learning.records import Answer, RetentionScore, Summary
from experiment.seed.seedtokenizer import SeedTokenizer


class Generation(msgspec.Struct, frozen=True):
    output_ids: list[int]  # the generated tokens, through the first EOS when there is one
    ended_with_eos: bool
    hit_token_limit: bool


def answer_text(tokenizer: SeedTokenizer, generation: Generation) -> str:
    """The text the checker sees: every generated token but the terminating EOS, special tokens included."""
    ids = generation.output_ids[:-1] if generation.ended_with_eos else generation.output_ids
    return tokenizer.decode(ids)


def evaluation_dir(home: Path, role: str, arm: str) -> Path:
    return home / layout.evaluation(role, arm)


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
