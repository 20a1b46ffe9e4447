"""The report checks serving against the model: a real `make run` bundle whose replicas served padding is refused,
and the same evidence with the served checkpoint's evaluated answers recomputes.

tests/data/evidence-lm-head-only.tar.xz is the evidence bundle of a `make run` whose checkpoints stored the tied
embedding as ``lm_head.weight``: HF evaluated them right (re-tying on load), vLLM built its embedding from nothing,
and every served request came back as token id 0, 96 times. The report of that run passed."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest

from experiment.core.errors import CoopError
from experiment.report.model import ServingReference
from experiment.report.recompute import compute
from tests.support import ROOT

BROKEN = ROOT / "tests" / "data" / "evidence-lm-head-only.tar.xz"
PHASES = ("single", "pair", "failure")


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("broken") / "evidence"
    with tarfile.open(BROKEN) as tar:
        tar.extractall(out, filter="data")
    return out


def _dev_answers(bundle: Path) -> dict[str, dict[str, Any]]:
    lines = (bundle / "evaluations" / "dev" / "clean-pair" / "answers.jsonl").read_text().splitlines()
    return {answer["id"]: answer for answer in map(json.loads, lines)}


def _served_as_evaluated(broken: Path, out: Path) -> Path:
    """The broken bundle with every completion replaced by the answer the dev evaluation gave to its task."""
    shutil.copytree(broken, out)
    evaluated = _dev_answers(out)
    for phase in PHASES:
        path = out / "serving" / f"{phase}.json"
        report = json.loads(path.read_bytes())
        for completion in report["completions"]:
            answer = evaluated[completion["task_id"]]
            completion |= {
                "output_ids": answer["output_ids"],
                "output_tokens": len(answer["output_ids"]),
                "correct": answer["check"]["correct"],
            }
        report["metrics"]["correct"] = sum(c["correct"] for c in report["completions"])
        path.write_text(json.dumps(report))
    return out


def test_the_evidence_of_replicas_that_served_padding_is_refused(broken: Path) -> None:
    single = json.loads((broken / "serving" / "single.json").read_bytes())
    assert all(c["output_ids"] == [0] * 96 for c in single["completions"])  # as the run recorded it
    with pytest.raises(CoopError) as refused:
        compute(broken)
    assert "serving/single.json: completions[0].output_ids: task " in str(refused.value)
    assert "only padding (96 x token id 0); no model answers that" in str(refused.value)


def test_the_same_evidence_with_the_evaluated_answers_is_reported(broken: Path, tmp_path: Path) -> None:
    serving = compute(_served_as_evaluated(broken, tmp_path / "evidence")).serving
    assert serving is not None
    evaluated = list(_dev_answers(broken).values())[:32]
    assert serving.reference == ServingReference(
        evaluation="evaluations/dev/clean-pair",
        device="cpu",
        tasks=32,
        correct=sum(a["check"]["correct"] for a in evaluated),
    )
    for phase in PHASES:
        checked = serving.agreement[phase]
        assert checked.tasks == checked.identical == checked.same_outcome == 32
        assert checked.token_agreement == 1.0
        assert checked.correct == serving.reference.correct == serving.phases[phase].correct


def test_one_served_token_other_than_the_evaluations_is_refused_and_named(broken: Path, tmp_path: Path) -> None:
    bundle = _served_as_evaluated(broken, tmp_path / "evidence")
    path = bundle / "serving" / "pair.json"
    report = json.loads(path.read_bytes())
    changed = report["completions"][3]
    changed["output_ids"][1] += 1
    path.write_text(json.dumps(report))
    with pytest.raises(CoopError) as refused:
        compute(bundle)
    message = str(refused.value)
    assert "serving/pair.json: completions.output_ids: are not the answers of evaluations/dev/clean-pair" in message
    assert "1 of 32 answers differ from the evaluation's output ids (at most 0 may on cpu):" in message
    assert f"\ntask {changed['task_id']} (dev index 3) from output token 1: served " in message
    assert message.count("\ntask ") == 1


def test_a_completion_that_claims_another_outcome_is_refused(broken: Path, tmp_path: Path) -> None:
    bundle = _served_as_evaluated(broken, tmp_path / "evidence")
    path = bundle / "serving" / "failure.json"
    report = json.loads(path.read_bytes())
    report["completions"][0]["correct"] = not report["completions"][0]["correct"]
    path.write_text(json.dumps(report))
    with pytest.raises(CoopError, match=r"failure\.json: completions\[0\]\.correct: is not the strict checker's"):
        compute(bundle)
