"""The committed real-model run (`make run PLAN=plans/smollm2-135m.toml`, bench/results/smollm2-135m/): its report is
what `coop report` recomputes from its committed evidence bundle, byte for byte, and its accuracy counts are the
strict checker's verdicts on the answers the bundle holds, against targets the task generator makes anew."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from experiment.core import tasks
from experiment.core.plan import load_plan
from tests.support import ROOT

RUN = ROOT / "bench" / "results" / "smollm2-135m"


def _bundle(tmp_path: Path) -> Path:
    folder = tmp_path / "evidence"
    with tarfile.open(RUN / "evidence.tar.gz") as tar:
        tar.extractall(folder, filter="data")
    return folder


def test_the_committed_report_is_what_coop_report_recomputes_from_the_committed_bundle(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path)
    output = tmp_path / "report.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "experiment.cli", "report", "--home", str(bundle), "--output", str(output)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert output.read_bytes() == (RUN / "report.json").read_bytes()


def test_the_committed_accuracy_is_the_strict_checkers_verdict_on_the_bundles_answers(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path)
    report = json.loads((RUN / "report.json").read_bytes())
    plan = load_plan(ROOT / "plans" / "smollm2-135m.toml")
    for arm in report["arms"]:
        lines = (bundle / "evaluations" / "test" / arm / "answers.jsonl").read_bytes().splitlines()
        answers = [json.loads(line) for line in lines]
        assert len(answers) == plan.tasks.test
        correct = 0
        for answer in answers:
            case = tasks.make_case(plan.tasks.task_seed, "test", answer["index"])
            correct += tasks.check(answer["text"], tasks.expected_answer(case)).correct
        assert report["accuracy"][arm]["overall"]["correct"] == correct, arm
