"""`coop --help`, `coop-server --help` and `coop-agent --help` answer without loading the heavy parts (torch,
transformers, the database layer, scipy, numpy): each command imports its own when it runs. The coordinator's app
loads neither the report's statistics (scipy) nor its figures (matplotlib) until it reports or draws."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "sqlalchemy", "scipy", "litestar", "numpy")
PROGRAM = """
import sys
from {module} import {parser}
for argv in (["--help"], {subcommand}):
    try:
        {parser}().parse_args(argv)
    except SystemExit:
        pass
print("loaded:", *sorted(name for name in {heavy} if name in sys.modules))
"""


@pytest.mark.parametrize(
    ("module", "parser", "subcommand"),
    [
        ("experiment.cli", "build_parser", ["train", "--help"]),
        ("server.cli", "_parser", ["experiment", "halt", "--help"]),
    ],
)
def test_help_loads_none_of_the_heavy_parts(module: str, parser: str, subcommand: list[str]) -> None:
    program = PROGRAM.format(module=module, parser=parser, subcommand=subcommand, heavy=HEAVY)
    answer = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True)
    assert "usage:" in answer.stdout
    assert answer.stdout.splitlines()[-1] == "loaded:", f"{module} --help imported {answer.stdout.splitlines()[-1]}"


def test_the_coordinators_app_loads_scipy_and_matplotlib_only_when_it_reports_or_draws() -> None:
    program = (
        "import sys, server.app; print(*sorted(n for n in ('scipy', 'matplotlib', 'torch') if n in sys.modules)); "
        "from server.web import charts; charts.lines('t', {'a': [(0.0, 1.0), (1.0, 2.0)]}, 'x', 'y'); "
        "from experiment.learning import stats; stats.sign_test(3, 1); "
        "print(*sorted(n for n in ('scipy', 'matplotlib') if n in sys.modules))"
    )
    answer = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    assert answer.stdout.splitlines() == ["", "matplotlib scipy"], answer.stdout
