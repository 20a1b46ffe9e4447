"""DiLoCo (experiment.learning.diloco, docs/local-sgd.md).

Its outer step on four real gloo ranks, against a single-process reference of the same arithmetic written here:
four models in one process, each with its own AdamW, and torch's own SGD with Nesterov momentum taking the outer
step on the mean pseudo-gradient. Then `coop train` of plans/local-diloco.toml's DiLoCo arm on four ranks of the
small seed: the workers meet only at the outer steps, a stopped run resumes at an outer step to the same
parameters, and a resume from another H or without the outer state is refused."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from experiment.core.plan import load_plan
from experiment.learning import corpus, training
from experiment.learning.corpus import load_prepared
from experiment.seed import seedmodel
from tests.conftest import write_plan
from tests.integration import diloco_probe as probe
from tests.support import ROOT
from tests.support.processes import coop_train, launch

pytestmark = pytest.mark.slow
Seed = tuple[Path, seedmodel.Snapshot]
WORKERS = 4
EVERY = 3
ROUNDS = 3
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


def reference(nesterov: bool = True) -> dict[str, torch.Tensor]:
    """The arithmetic in one process: every worker's inner AdamW from the shared weights, then torch.optim.SGD
    on the shared weights with the mean of (shared - worker) as the gradient."""
    workers = [probe.model() for _ in range(WORKERS)]
    shared = probe.model()
    inner = [
        torch.optim.AdamW(w.parameters(), lr=probe.INNER_LEARNING_RATE, weight_decay=probe.WEIGHT_DECAY)
        for w in workers
    ]
    outer = torch.optim.SGD(shared.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=nesterov)
    for round_ in range(1, ROUNDS + 1):
        for rank, (worker, optimizer) in enumerate(zip(workers, inner, strict=True)):
            for local in range(1, EVERY + 1):
                x, y = probe.batch(rank, (round_ - 1) * EVERY + local)
                loss = torch.nn.functional.mse_loss(worker(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        with torch.no_grad():
            for name, parameter in shared.named_parameters():
                moved = [dict(w.named_parameters())[name] for w in workers]
                parameter.grad = torch.stack([parameter - m for m in moved]).mean(dim=0)
        outer.step()
        with torch.no_grad():
            for worker in workers:
                for target, source in zip(worker.parameters(), shared.parameters(), strict=True):
                    target.copy_(source)
    return {name: p.detach().clone() for name, p in shared.named_parameters()}


def run(out: Path, *extra: str) -> list[dict[str, torch.Tensor]]:
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "tests.integration.diloco_probe", "--out", str(out), "--every", str(EVERY)]
    argv += ["--rounds", str(ROUNDS), "--outer-lr", str(OUTER_LR), "--outer-momentum", str(OUTER_MOMENTUM), *extra]
    ranks = launch(argv, WORKERS)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    return [load_file(str(out / f"params-rank{rank}.safetensors")) for rank in range(WORKERS)]


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    out = tmp_path_factory.mktemp("diloco") / "uninterrupted"
    return out, run(out)


def test_four_gloo_workers_compute_the_single_process_reference(
    uninterrupted: tuple[Path, list[dict[str, torch.Tensor]]],
) -> None:
    out, ranks = uninterrupted
    # Every worker ends on the same outer parameters, bit for bit.
    assert all(set(r) == set(ranks[0]) and all(torch.equal(r[n], ranks[0][n]) for n in r) for r in ranks[1:])
    expected = reference()
    # The all-reduce adds in its own order, so the last bits may differ; a wrong outer step differs by far more
    # (the same run with plain momentum instead of Nesterov's is the measure).
    difference = _max_difference(ranks[0], expected)
    wrong = _max_difference(reference(nesterov=False), expected)
    assert difference <= 1e-6 < wrong / 1000, (difference, wrong)
    # Each worker handed one all-reduce of every parameter per outer step: 4 bytes a float32 parameter.
    parameters = sum(p.numel() for p in expected.values())
    assert [json.loads((out / f"handed-rank{r}.json").read_text()) for r in range(WORKERS)] == [
        ROUNDS * 4 * parameters
    ] * WORKERS


# `coop train` of the local-SGD plan's DiLoCo arm: four real ranks on the small seed, an outer step every 2 updates.
DILOCO_PLAN = ROOT / "plans" / "local-diloco.toml"
ARM = "diloco-4"


def _prepared(folder: Path, seed: Seed, sync_every: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    # DiLoCo's published outer step, so that a resume carries a momentum that is not zero.
    outer = {"outer_learning_rate": OUTER_LR, "outer_momentum": OUTER_MOMENTUM}
    plan_path = write_plan(folder / "plan.toml", seed[1], base=DILOCO_PLAN, sync_every=sync_every, **outer)
    corpus.prepare(load_plan(plan_path), plan_path, folder / "home", seed[0], None, lambda event: None)
    return folder / "home"


def _copy(home: Path, folder: Path) -> Path:
    shutil.copytree(home / "prepared", folder / "home" / "prepared")
    return folder / "home"


def _train(home: Path, seed: Seed, *extra: str) -> list[list[dict[str, Any]]]:
    ranks = coop_train(home, seed[0], ARM, WORKERS, *extra)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    return [[json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")] for r in ranks]


@pytest.fixture(scope="module")
def diloco_home(tmp_path_factory: pytest.TempPathFactory, small_seed: Seed) -> Path:
    return _prepared(tmp_path_factory.mktemp("diloco-plan"), small_seed, sync_every=2)


@pytest.fixture(scope="module")
def trained(diloco_home: Path, small_seed: Seed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = _copy(diloco_home, tmp_path_factory.mktemp("diloco-trained"))
    _train(home, small_seed)
    return home


def _result(home: Path, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((training.run_dir(home, ARM, rank) / "result.json").read_text())
    return result


def test_a_diloco_arm_trains_four_workers_that_meet_only_at_the_outer_steps(trained: Path) -> None:
    plan = load_prepared(trained).plan
    results = [_result(trained, rank) for rank in range(WORKERS)]
    # Every worker ends on the last outer step's parameters.
    assert len({r["parameter_digest"] for r in results}) == 1
    outer_steps = plan.training.updates // 2
    for result in results:
        assert result["communication"] | {"outer_allreduce_bytes": None} == result["communication"] | {
            "synchronization": "diloco",
            "sync_every": 2,
            "outer_steps": outer_steps,
            "outer_allreduce_bytes": None,
        }
        # One all-reduce of every float32 parameter per outer step, and none in between.
        assert result["communication"]["outer_allreduce_bytes"] == outer_steps * 4 * plan.seed.parameters


def _refused(home: Path, seed: Seed, says: str) -> None:
    """Every rank exits 2 naming ``says``, and the home holds the same files as before."""
    before = {p.relative_to(home).as_posix(): p.stat().st_mtime_ns for p in home.rglob("*")}
    ranks = coop_train(home, seed[0], ARM, WORKERS)
    assert {r.returncode for r in ranks} == {2}, [r.stderr[-1500:] for r in ranks]
    assert any(says in r.stderr for r in ranks), [r.stderr[-1500:] for r in ranks]
    assert {p.relative_to(home).as_posix(): p.stat().st_mtime_ns for p in home.rglob("*")} == before


def test_a_diloco_run_stopped_mid_way_resumes_at_an_outer_step_and_refuses_another_h_or_no_outer_state(
    diloco_home: Path, trained: Path, small_seed: Seed, tmp_path: Path
) -> None:
    home = _copy(diloco_home, tmp_path / "stopped")
    _train(home, small_seed, "--stop-after", "3")  # past the outer step and checkpoint at 2
    # The same checkpoints under a plan with another H: the run's binding differs, and no rank resumes.
    other = _prepared(tmp_path / "other", small_seed, sync_every=1)
    shutil.copytree(home / "runs", other / "runs")
    _refused(other, small_seed, "binding")
    # A checkpoint whose outer state is gone is not the run's full state.
    missing = shutil.copytree(home, tmp_path / "missing" / "home")
    (training.run_dir(missing, ARM, 1) / "checkpoints" / "step-000002" / training.OUTER).unlink()
    _refused(missing, small_seed, training.OUTER)
    # Untouched, the stopped run resumes at the outer step to the uninterrupted run's parameters.
    resumed = _train(home, small_seed)
    assert {events[0]["resumed_from_step"] for events in resumed} == {2}
    assert {_result(home, r)["parameter_digest"] for r in range(WORKERS)} == {_result(trained, 0)["parameter_digest"]}
