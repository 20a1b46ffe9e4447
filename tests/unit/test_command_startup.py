"""`coop --help`, `coop-server --help` and `coop-agent --help` answer without loading the heavy parts (torch,
transformers, the database layer, scipy, numpy): each command imports its own when it runs. The coordinator's app
loads neither the report's statistics (scipy) nor its figures (matplotlib) until it reports or draws.

The commands that compute without a model (report, benchmark, probe, prepare, checkpoint verify, plan,
reference-home snapshot, seed-model snapshot) run here in a fresh interpreter, each on real small inputs where that is
cheap, and load neither torch nor transformers; `coop report` needs only the base install (no httpx, no psutil). A
command whose packages are missing says in one line what installs them, and exits 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from experiment import cli
from tests.support import ROOT

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
# The packages a command of the base install must not need, and those only a host's commands import.
WATCHED = ("torch", "transformers", "httpx", "psutil", "sqlalchemy")
# `coop ARGV...` as the console script runs it, then the watched packages it imported; the packages named in
# COOP_MISSING are absent, as in a venv that lacks them.
COMMAND = f"""
import os, sys
for name in os.environ.get("COOP_MISSING", "").split():
    sys.modules[name] = None
from experiment.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("loaded:", *sorted(name for name in {WATCHED} if name in sys.modules))
sys.exit(code)
"""
TINY = ROOT / "seeds" / "tiny"
LOCAL_PLAN = ROOT / "plans" / "local.toml"


def _coop(*argv: str | Path, missing: str = "", **environ: str) -> tuple[int, list[str], str]:
    """The exit status, the watched packages it loaded, and its stderr."""
    env = {**os.environ, **environ, "COOP_MISSING": missing}
    done = subprocess.run(
        [sys.executable, "-c", COMMAND, *map(str, argv)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    last = done.stdout.splitlines()[-1]
    assert last.startswith("loaded:"), done.stdout + done.stderr
    return done.returncode, last.split()[1:], done.stderr


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


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["report", "--help"], ["plan", "show", LOCAL_PLAN], ["seed-model", "snapshot", TINY]],
    ids=["help", "report-help", "plan-show", "seed-model-snapshot"],
)
def test_a_command_without_a_model_loads_none_of_the_host_packages(argv: list[str | Path]) -> None:
    code, loaded, stderr = _coop(*argv)
    assert (code, loaded) == (0, []), stderr


def test_report_recomputes_the_committed_bundle_with_the_base_install_alone(tmp_path: Path) -> None:
    """The committed SmolLM2 run's bundle, recomputed whole (tests/integration/test_smollm2_run.py checks the bytes)."""
    bundle = tmp_path / "evidence"
    with tarfile.open(ROOT / "bench" / "results" / "smollm2-135m" / "evidence.tar.gz") as tar:
        tar.extractall(bundle, filter="data")
    code, loaded, stderr = _coop("report", "--home", bundle, "--output", tmp_path / "report.json")
    assert (code, loaded) == (0, []), stderr
    assert (tmp_path / "report.html").is_file()


def test_prepare_and_the_commands_that_read_a_prepared_home_load_neither_torch_nor_transformers(
    tmp_path: Path,
) -> None:
    """prepare on the committed tiny seed, then checkpoint verify of its baseline arm; probe and benchmark read the
    home and refuse before any replica is needed (no dev evaluation to check one against; a stop past the
    workload), with httpx and Litestar (whose optional SQLAlchemy support loads where the server extra is
    installed); a replica told its device never asks torch for one."""
    home, token = tmp_path / "home", tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    code, loaded, stderr = _coop("prepare", "--plan", LOCAL_PLAN, "--home", home, "--model-dir", TINY)
    assert (code, loaded) == (0, []), stderr
    code, loaded, stderr = _coop("checkpoint", "verify", "--home", home, "--arm", "seed", "--model-dir", TINY)
    assert (code, loaded) == (0, []), stderr
    probe = ("probe", "--home", home, "--model-dir", TINY, "--replica", "http://127.0.0.1:9", "--port", "9")
    code, loaded, stderr = _coop(*probe, "--token-file", token, "--expect", tmp_path / "none")
    assert code == 2 and not {"torch", "transformers"} & set(loaded), loaded
    assert "holds no finished evaluation" in stderr, stderr
    endpoints = ("--endpoint", "http://127.0.0.1:9", "--endpoint", "http://127.0.0.1:10")
    benchmark = ("benchmark", *endpoints, "--phase", "failure", "--home", home)
    code, loaded, stderr = _coop(
        *benchmark, "--token-file", token, "--output", tmp_path / "p.json", "--stop-after", "999"
    )
    assert code == 2 and not {"torch", "transformers"} & set(loaded), loaded
    assert "--stop-after must be between" in stderr, stderr
    replica = ("replica", "--model-dir", TINY, "--served-model-name", "a" * 64, "--port", "9", "--device", "cpu")
    code, loaded, stderr = _coop(*replica, COOP_VLLM_PYTHON=str(tmp_path / "no-vllm" / "python"))
    assert (code, loaded) == (2, []) and "no vLLM interpreter" in stderr, stderr


def test_reference_home_snapshot_loads_neither_torch_nor_transformers(tmp_path: Path) -> None:
    shutil.copyfile(ROOT / "plans" / "local-reference" / "replay.jsonl", tmp_path / "train-replay.jsonl")
    shutil.copyfile(ROOT / "plans" / "local-reference" / "retention.jsonl", tmp_path / "retention-probes.jsonl")
    code, loaded, stderr = _coop("reference-home", "snapshot", "--plan", ROOT / "plans" / "reference.toml", tmp_path)
    assert (code, loaded) == (0, []), stderr


@pytest.mark.parametrize(
    ("argv", "missing", "line"),
    [
        (["report", "--home", "bundle", "--output", "r.json"], "numpy", f"coop report needs numpy: {cli.INSTALL_BASE}"),
        (
            ["checkpoint", "verify", "--home", "h", "--arm", "a", "--model-dir", "m"],
            "tokenizers",
            f"coop checkpoint verify needs tokenizers: {cli.INSTALL_BASE}",
        ),
        (
            ["train", "--home", "h", "--model-dir", "m", "--arm", "a"],
            "torch",
            f"coop train needs torch: {cli.INSTALL_HOST}",
        ),
    ],
    ids=["report-numpy", "verify-tokenizers", "train-torch"],
)
def test_a_command_whose_package_is_missing_names_its_install_in_one_line(
    argv: list[str], missing: str, line: str
) -> None:
    code, _, stderr = _coop(*argv, missing=missing)
    assert (code, stderr) == (2, line + "\n")


def test_the_agents_doctor_with_a_plan_loads_neither_torch_nor_transformers(tmp_path: Path) -> None:
    """The agent never imports torch (it holds no CUDA context on the card its jobs share), its doctor included,
    though it reads the preflight's rules and verifies the seed."""
    program = (
        "import sys\nfrom agent import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as exc:\n"
        "    print('exit', exc.code)\n"
        "print('loaded:', *sorted(n for n in ('torch', 'transformers') if n in sys.modules))"
    )
    argv = ["doctor", "--coordinator", "http://127.0.0.1:9", "--work-dir", tmp_path / "work", "--model-dir", TINY]
    done = subprocess.run(
        [sys.executable, "-c", program, *map(str, argv), "--plan", str(LOCAL_PLAN), "--device", "cpu"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert "ok    seed: " in done.stdout and "FAIL  coordinator: " in done.stdout, done.stdout + done.stderr
    assert lines[-2:] == ["exit 2", "loaded:"], done.stdout


def test_the_commands_that_train_evaluate_and_check_load_torch_without_transformers() -> None:
    """Training, evaluation, the canary and the rerun compute with the seed's own Llama (experiment.seed.llama):
    a process that loads the tiny seed and answers with it never imports transformers, whose import alone costs
    each such process seconds of CPU."""
    program = (
        "import sys, torch\n"
        "from experiment.learning import training, evaluation, rerun, decoding\n"
        "from experiment.serving import canary\n"
        f"model = evaluation.answering_model(training.seedmodel.load_model(__import__('pathlib').Path({str(TINY)!r})),"
        " 'cpu', 'float32')\n"
        "print(decoding.generate(model, [[1, 2, 3]], eos_id=2, pad_id=0, max_new_tokens=4, batch_size=1)[0])\n"
        "print('loaded:', *sorted(n for n in ('torch', 'transformers') if n in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = done.stdout.splitlines()
    assert lines and lines[-1] == "loaded: torch", done.stdout + done.stderr
    assert lines[0].startswith("Generation(output_ids=["), done.stdout
