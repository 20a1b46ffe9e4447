"""COOP_FAILPOINTS: what it arms, and a setting that names no point is refused when the coordinator starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiment.core.errors import CoopError
from server import failpoints
from tests.support import ROOT


def test_points_are_armed_by_visit_and_a_count_left_out_is_the_first() -> None:
    assert failpoints.parse("blob.installed:2, report.written") == {"blob.installed": 2, "report.written": 1}
    assert failpoints.parse("") == {}


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("blob.nowhere", "'blob.nowhere', which is none of"),
        ("blob.installed:0", "a whole number from 1"),
        ("blob.installed:two", "a whole number from 1"),
    ],
)
def test_a_setting_that_names_no_point_or_no_visit_is_refused(setting: str, said: str) -> None:
    with pytest.raises(CoopError, match=said):
        failpoints.parse(setting)


def test_the_coordinator_refuses_to_start_with_an_unknown_point(tmp_path: Path) -> None:
    environment = {**os.environ, "COOP_HOME": str(tmp_path), "COOP_FAILPOINTS": "result.lost"}
    ran = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--port", "1"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 2
    assert "COOP_FAILPOINTS names 'result.lost'" in ran.stderr
