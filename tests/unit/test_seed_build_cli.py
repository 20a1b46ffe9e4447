"""`coop seed-model build` pins the CPU kernels, so its bytes do not depend on the processor's vector width."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from experiment.seed.tinyseed import CPU_KERNELS

ROOT = Path(__file__).resolve().parents[2]


def _files(out: Path, *command: str, env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    built = [json.loads(line) for line in done.stdout.splitlines() if '"seed-built"' in line]
    assert len(built) == 1
    assert built[0]["out"] == str(out)
    files: dict[str, str] = built[0]["snapshot"]["files"]
    return files


def test_the_cli_build_equals_a_build_with_the_kernels_pinned(tmp_path: Path) -> None:
    plain = {k: v for k, v in os.environ.items() if k not in CPU_KERNELS}
    cli = _files(
        tmp_path / "cli",
        sys.executable,
        "-m",
        "experiment.cli",
        "seed-model",
        "build",
        "--small",
        "--out",
        str(tmp_path / "cli"),
        env=plain,
    )
    script = (
        "import json, sys; from pathlib import Path; from experiment.seed import tinyseed as s; "
        "snap = s.build_seed(Path(sys.argv[1]), s.SMALL); "
        "print(json.dumps({'event': 'seed-built', 'out': sys.argv[1], 'snapshot': {'files': snap.files}}))"
    )
    pinned = _files(
        tmp_path / "pinned", sys.executable, "-c", script, str(tmp_path / "pinned"), env={**plain, **CPU_KERNELS}
    )
    assert cli == pinned
