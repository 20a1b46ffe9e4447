"""`coop --help`, `coop-server --help` and `coop-agent --help` answer without loading the heavy parts (torch,
transformers, the database layer, scipy, numpy): each command imports its own when it runs."""

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
