"""`coop canary` on one host whose replica reads the seed otherwise than transformers: the canary's replica step
fails naming the task the replica answered differently, with its fix, and no later step runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from experiment.seed import seedmodel
from tests.conftest import write_plan
from tests.integration.serving.support import TINY, needs_vllm
from tests.support import ROOT

pytestmark = [pytest.mark.slow, needs_vllm]


def test_a_canary_whose_replica_answers_otherwise_than_the_evaluation_fails_at_the_replica_naming_the_task(
    tmp_path: Path,
) -> None:
    # The defect the probe exists for, in the seed itself: its tied embedding saved as lm_head.weight. transformers
    # re-ties the pair on load and answers as the seed; vLLM keeps the lm_head and builds its embedding from nothing.
    seed = tmp_path / "seed"
    shutil.copytree(TINY, seed)
    tensors = load_file(str(seed / "model.safetensors"))
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(seed / "model.safetensors"), metadata={"format": "pt"})
    plan = write_plan(tmp_path / "plan.toml", seedmodel.snapshot_of(seed))
    argv = [sys.executable, "-m", "experiment.cli", "canary", "--plan", str(plan), "--home", str(tmp_path / "home")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*argv, "--model-dir", str(seed)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]  # a verdict, not a crash
    verdict = json.loads(done.stdout.splitlines()[-1])
    assert verdict["event"] == "canaried" and verdict["passed"] is False and verdict["world_size"] == 1
    steps = {step["name"]: step for step in verdict["steps"]}
    assert list(steps) == ["prepare", "all-reduce", "ddp-update", "checkpoint", "evaluate", "replica"]
    assert all(steps[name]["passed"] for name in list(steps)[:-1])
    replica = steps["replica"]
    assert not replica["passed"] and "coop-agent doctor" in replica["fix"]
    first = json.loads((tmp_path / "home" / "prepared" / "dev.jsonl").read_text().splitlines()[0])
    assert f"the replica's answer to dev task {first['id']} (index 0) is only padding" in replica["failure"]
    # The replica was stopped all the same: nothing listens or runs after the canary.
    assert "vllm" not in subprocess.run(["pgrep", "-af", str(seed)], capture_output=True, text=True).stdout
