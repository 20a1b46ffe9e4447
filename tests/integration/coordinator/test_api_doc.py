"""docs/api.md's Python example, run as written against a real coordinator that recorded the SmolLM2-135M run
(bench/results/smollm2-135m) with a reader token, its frames checked against that run's evidence bundle."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.support import finished_experiment, host_agent, smollm2_lines, smollm2_report, smollm2_run
from tests.support import ROOT
from tests.support.database import make_token
from tests.support.processes import QUICK, CoordinatorProcess

ARMS = ("seed", "clean-single", "damaged-single", "clean-pair")


def python_example() -> str:
    """The one ```python block of docs/api.md."""
    (block,) = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), flags=re.DOTALL)
    return str(block)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    server = CoordinatorProcess(tmp_path, **QUICK)
    try:
        server.start()
        yield server
    finally:
        server.close()


def test_the_python_example_loads_the_runs_answers_and_training_curve_into_pandas(
    coordinator: CoordinatorProcess, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    experiment = finished_experiment(coordinator, host_agent(coordinator, "host-a"), host_agent(coordinator, "host-b"))
    monkeypatch.setenv("COOP_URL", coordinator.url)
    monkeypatch.setenv("COOP_EXPERIMENT", experiment)
    monkeypatch.setenv("COOP_TOKEN", make_token(coordinator.database_url, "reader", "analyst"))
    namespace: dict[str, Any] = {}
    exec(compile(python_example(), "docs/api.md", "exec"), namespace)

    report = smollm2_report()
    assert namespace["verdict"] == report["primary"]["verdict"]
    assert "verdict: PASSED" in capsys.readouterr().out
    answers, exact = namespace["answers"], namespace["exact"]
    for arm in ARMS:
        published = smollm2_lines(f"evaluations/test/{arm}/answers.jsonl")
        mine = answers[answers["arm"] == arm]
        assert list(mine["task"]) == [line["id"] for line in published]
        assert list(mine["correct"]) == [line["check"]["correct"] for line in published]
        assert int(exact.loc[arm].sum()) == sum(line["check"]["correct"] for line in published)
    assert len(answers) == 4 * 256
    curve = namespace["curve"]
    journal = smollm2_run("clean-single", 0)["journal"]
    assert list(curve.index) == [entry["step"] for entry in journal] == list(range(1, 129))
    assert list(curve["loss"]) == [entry["loss"] for entry in journal]
