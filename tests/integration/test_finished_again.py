"""A rank whose run finished before (its attempt lost before the result reached the coordinator) runs again to its
final checkpoint and reports that run's result file unchanged. Nothing it prints may contradict that file: the
coordinator refuses a result whose steps or resource samples differ from the attempt's events, and the retry would
then be refused on every host that holds the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from experiment.core.plan import load_plan
from experiment.learning import corpus
from experiment.seed import seedmodel
from tests.conftest import write_plan
from tests.support.processes import coop_train


def _events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(
    "unpointed_final_checkpoint", [False, True], ids=["from-the-final-step", "retraining-the-last-steps"]
)
def test_a_run_that_finished_before_reports_its_result_again_and_no_event_contradicts_it(
    small_seed: tuple[Path, seedmodel.Snapshot], tmp_path: Path, unpointed_final_checkpoint: bool
) -> None:
    plan = write_plan(tmp_path / "plan.toml", small_seed[1])
    home = tmp_path / "home"
    corpus.prepare(load_plan(plan), plan, home, small_seed[0], None, lambda event: None)
    (first,) = coop_train(home, small_seed[0], "clean-single", 1)
    assert first.returncode == 0, first.stderr[-2000:]
    path = home / "runs" / "clean-single" / "rank-0" / "result.json"
    written = path.read_bytes()
    assert any(e["event"] == "resources" for e in _events(first.stdout))  # a fresh run reports its samples live

    run_dir = path.parent
    if unpointed_final_checkpoint:  # a kill came before its pointer: it retrains steps 3 and 4 to confirm it, as a
        (run_dir / "pointers" / "step-000004.json").unlink()  # rank of a pair does to meet a peer behind it
    (again,) = coop_train(home, small_seed[0], "clean-single", 1)
    assert again.returncode == 0, again.stderr[-2000:]
    assert path.read_bytes() == written  # reported again, unchanged
    result = json.loads(written)
    events = _events(again.stdout)
    (started,) = [e for e in events if e["event"] == "started"]
    assert started["resumed_from_step"] == (2 if unpointed_final_checkpoint else 4)  # the small plan: 4 updates
    assert len([e for e in events if e["event"] == "step"]) == (2 if unpointed_final_checkpoint else 0)
    for event in events:
        if event["event"] == "resources":
            sample = {k: v for k, v in event.items() if k not in {"event", "arm", "rank", "step", "index"}}
            assert sample == result["resource_samples"][event["index"]]
        if event["event"] == "step":
            (entry,) = [e for e in result["journal"] if e["step"] == event["step"]]
            assert {k: event[k] for k in entry} == entry
    (completed,) = [e for e in events if e["event"] == "completed"]
    assert completed["parameter_digest"] == result["parameter_digest"]
