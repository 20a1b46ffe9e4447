"""The training engine with real processes on gloo and the tiny seed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from experiment.core.canonical import canonical_bytes, sha256_file
from experiment.core.errors import EXIT_LINK
from experiment.core.plan import load_plan
from experiment.learning import corpus, distributed, training, updates
from experiment.seed import seedmodel
from tests.conftest import write_plan
from tests.support.processes import coop_train, free_port, launch, rank_env

Seed = tuple[Path, seedmodel.Snapshot]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, small_seed: Seed) -> Path:
    folder = tmp_path_factory.mktemp("train")
    plan_path = write_plan(folder / "plan.toml", small_seed[1])
    corpus.prepare(load_plan(plan_path), plan_path, folder / "home", small_seed[0], None, lambda event: None)
    return folder / "home"


def _probe(home: Path, seed: Path, out: Path, world: int, wrong_scale: bool) -> None:
    out.mkdir(parents=True)
    args = [
        sys.executable,
        "-m",
        "tests.integration.ddp_probe",
        "--home",
        str(home),
        "--model-dir",
        str(seed),
        "--out",
        str(out),
    ] + (["--wrong-scale"] if wrong_scale else [])
    for done in launch(args, world):
        assert done.returncode == 0, done.stderr


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=rtol, atol=atol) for k in a)


def test_schedule_batches_mix_weights_and_unequal_target_counts(home: Path) -> None:
    prepared = corpus.load_prepared(home)
    documents = prepared.documents("train-clean")
    batches = training.schedule(prepared.plan)
    assert sorted(p for batch in batches for p in batch) == list(range(len(documents)))
    for batch in batches[:3]:
        for rank in (0, 1):
            mine = updates.local_positions(batch, distributed.World(rank, 2, "127.0.0.1", 0))
            assert {documents[p].weight for p in mine} == {1, 8}
        assert len({documents[p].targets for p in batch}) > 2


@pytest.fixture(scope="module")
def single(home: Path, small_seed: Seed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process reference: gradients of update 1, parameters after update 3."""
    out = tmp_path_factory.mktemp("single") / "out"
    _probe(home, small_seed[0], out, 1, wrong_scale=False)
    return out


@pytest.mark.parametrize("wrong_scale", [False, True], ids=["protocol-scale", "negative-control-wrong-scale"])
def test_pair_update_equals_single_process_reference(
    home: Path, single: Path, small_seed: Seed, tmp_path: Path, wrong_scale: bool
) -> None:
    _probe(home, small_seed[0], tmp_path / "pair", 2, wrong_scale=wrong_scale)
    single_grads = load_file(str(single / "grads-rank0.safetensors"))
    pair_grads = [load_file(str(tmp_path / "pair" / f"grads-rank{r}.safetensors")) for r in (0, 1)]
    single_params = load_file(str(single / "params-rank0.safetensors"))
    pair_params = [load_file(str(tmp_path / "pair" / f"params-rank{r}.safetensors")) for r in (0, 1)]
    # the two ranks hold bit-identical gradients and parameters
    assert all(torch.equal(pair_grads[0][k], pair_grads[1][k]) for k in pair_grads[0])
    assert all(torch.equal(pair_params[0][k], pair_params[1][k]) for k in pair_params[0])
    # gradients of the first update (AdamW would hide a loss-scale error in parameters), then parameters
    # after 3 updates, equal the single-process reference up to reduction order
    matches = _close(single_grads, pair_grads[0], rtol=1e-4, atol=1e-7) and _close(
        single_params, pair_params[0], rtol=1e-4, atol=1e-6
    )
    assert matches != wrong_scale


def _events(done: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _fresh_home(home: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "home"
    shutil.copytree(home / "prepared", copy / "prepared")
    return copy


@pytest.fixture(scope="module")
def stopped(home: Path, small_seed: Seed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean-single run interrupted after update 3: its last checkpoint is step 2."""
    broken = _fresh_home(home, tmp_path_factory.mktemp("stopped"))
    [done] = coop_train(broken, small_seed[0], "clean-single", 1, "--stop-after", "3")
    assert done.returncode == 0, done.stderr
    assert not (training.run_dir(broken, "clean-single", 0) / "result.json").exists()
    return broken


def _copy(home: Path, tmp_path: Path) -> Path:
    shutil.copytree(home, tmp_path / "copy")
    return tmp_path / "copy"


def test_interrupted_run_resumes_to_the_same_final_digest(
    home: Path, stopped: Path, small_seed: Seed, tmp_path: Path
) -> None:
    whole = _fresh_home(home, tmp_path / "whole")
    [done] = coop_train(whole, small_seed[0], "clean-single", 1)
    assert done.returncode == 0, done.stderr
    uninterrupted = _events(done)[-1]["parameter_digest"]

    broken = _copy(stopped, tmp_path)
    [resumed] = coop_train(broken, small_seed[0], "clean-single", 1)
    assert resumed.returncode == 0, resumed.stderr
    events = _events(resumed)
    assert events[0]["resumed_from_step"] == 2
    assert events[-1]["parameter_digest"] == uninterrupted

    # Trained again, as when the attempt that finished was lost before it reported (its host cut off): the run
    # resumes from its final checkpoint to the same parameters and reports its result file again, unchanged.
    path = training.run_dir(broken, "clean-single", 0) / "result.json"
    written = path.read_bytes()
    [again] = coop_train(broken, small_seed[0], "clean-single", 1)
    assert again.returncode == 0, again.stderr
    repeated = _events(again)
    assert repeated[0]["resumed_from_step"] == corpus.load_prepared(broken).plan.training.updates
    assert repeated[-1]["event"] == "completed" and repeated[-1]["result"] == str(path)
    assert repeated[-1]["parameter_digest"] == uninterrupted and path.read_bytes() == written


@pytest.fixture(scope="module")
def whole_pair(home: Path, small_seed: Seed, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The clean pair trained without interruption: its home and each rank's final parameter digest."""
    whole = _fresh_home(home, tmp_path_factory.mktemp("whole-pair"))
    runs = coop_train(whole, small_seed[0], "clean-pair", 2)
    for done in runs:
        assert done.returncode == 0, done.stderr
    return whole, [str(_events(done)[-1]["parameter_digest"]) for done in runs]


@pytest.fixture(scope="module")
def uninterrupted_pair(whole_pair: tuple[Path, list[str]]) -> str:
    """The final parameter digest of the clean pair trained without interruption."""
    (digest,) = set(whole_pair[1])
    return digest


def test_pair_arm_runs_two_ranks_that_agree_on_the_final_digest(whole_pair: tuple[Path, list[str]]) -> None:
    pair, digests = whole_pair
    assert len(set(digests)) == 1
    for rank in (0, 1):
        result = json.loads((training.run_dir(pair, "clean-pair", rank) / "result.json").read_text())
        assert result["world_size"] == 2 and result["rank"] == rank
        assert result["parameter_digest"] == digests[rank]
        assert [r["step"] for r in result["journal"]] == [1, 2, 3, 4]
        assert all(r["documents"] == 4 for r in result["journal"])
        # Every rank keeps a loadable copy of the weights (each host resumes and serves from its own).
        folder = training.run_dir(pair, "clean-pair", rank) / "checkpoints" / "step-000004" / "model"
        model = seedmodel.load_model(folder)
        assert distributed.parameter_digest(model) == result["parameter_digest"]


@pytest.fixture(scope="module")
def stopped_pair(home: Path, small_seed: Seed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pair stopped after its last update (--stop-after 4): both ranks hold step 4, and neither a result."""
    broken = _fresh_home(home, tmp_path_factory.mktemp("stopped-pair"))
    runs = coop_train(broken, small_seed[0], "clean-pair", 2, "--stop-after", "4")
    assert all(done.returncode == 0 for done in runs), [done.stderr for done in runs]
    return broken


def _pair_killed_while_saving(stopped_pair: Path, tmp_path: Path, moment: str) -> Path:
    """A copy of the stopped pair whose rank 1 then looks as if its host died while saving step 4, while rank 0's
    step 4 is complete: before the folder's rename (still partial, no pointer) or between the rename and the
    pointer's write (complete, no pointer)."""
    broken = tmp_path / "broken"
    shutil.copytree(stopped_pair, broken)
    behind = training.run_dir(broken, "clean-pair", 1)
    (behind / "pointers" / "step-000004.json").unlink()
    if moment == "before-rename":
        (behind / "checkpoints" / "step-000004").rename(behind / "checkpoints" / ".step-000004.partial")
    else:
        assert moment == "before-pointer"
    return broken


@pytest.mark.parametrize(("moment", "rank1_wrote"), [("before-rename", "checkpoint"), ("before-pointer", "pointer")])
def test_a_pair_resumes_from_the_last_checkpoint_both_ranks_hold(
    stopped_pair: Path, small_seed: Seed, uninterrupted_pair: str, tmp_path: Path, moment: str, rank1_wrote: str
) -> None:
    broken = _pair_killed_while_saving(stopped_pair, tmp_path, moment)
    receipts = [
        training.run_dir(broken, "clean-pair", r) / "checkpoints" / "step-000004" / "receipt.json" for r in (0, 1)
    ]
    before = [path.read_bytes() if path.exists() else None for path in receipts]

    runs = coop_train(broken, small_seed[0], "clean-pair", 2)
    assert all(done.returncode == 0 for done in runs), [done.stderr for done in runs]
    for rank, done in enumerate(runs):
        events = _events(done)
        assert events[0]["resumed_from_step"] == 2
        (saved,) = [e for e in events if e["event"] == "checkpoint"]
        # Rank 0 retrained to its own step 4 and kept it (the same weights). Rank 1 wrote its step 4 anew, or
        # kept the complete one the kill left and wrote only the pointer it lacked.
        assert (saved["step"], saved["written"]) == (4, "nothing" if rank == 0 else rank1_wrote)
        assert events[-1]["parameter_digest"] == uninterrupted_pair
        result = json.loads((training.run_dir(broken, "clean-pair", rank) / "result.json").read_text())
        assert [r["step"] for r in result["journal"]] == [1, 2, 3, 4]
        assert (training.run_dir(broken, "clean-pair", rank) / "pointers" / "step-000004.json").is_file()
    # What a rank held before is byte for byte what it holds now.
    assert [path.read_bytes() for path, old in zip(receipts, before, strict=True) if old] == [b for b in before if b]
    assert (before[1] is None) == (moment == "before-rename")


def test_a_kept_checkpoint_that_retraining_does_not_reproduce_is_refused(
    stopped_pair: Path, small_seed: Seed, tmp_path: Path
) -> None:
    broken = _pair_killed_while_saving(stopped_pair, tmp_path, "before-rename")
    run = training.run_dir(broken, "clean-pair", 0)
    receipt_path = run / "checkpoints" / "step-000004" / "receipt.json"
    receipt = json.loads(receipt_path.read_text())
    receipt["parameter_digest"] = "0" * 64  # a consistent checkpoint of other weights
    receipt_path.write_bytes(canonical_bytes(receipt) + b"\n")
    pointer_path = run / "pointers" / "step-000004.json"
    pointer = {**json.loads(pointer_path.read_text()), "receipt_sha256": sha256_file(receipt_path)}
    pointer_path.write_bytes(canonical_bytes(pointer) + b"\n")

    runs = coop_train(broken, small_seed[0], "clean-pair", 2)
    assert runs[0].returncode == 2 and "retraining to step 4 gave" in runs[0].stderr, runs[0].stderr
    assert runs[1].returncode != 0
    assert not any((training.run_dir(broken, "clean-pair", r) / "result.json").exists() for r in (0, 1))
    assert json.loads(receipt_path.read_text())["parameter_digest"] == "0" * 64


def test_single_arm_refuses_a_world_of_two(home: Path, small_seed: Seed, tmp_path: Path) -> None:
    runs = coop_train(_fresh_home(home, tmp_path), small_seed[0], "clean-single", 2)
    assert all(done.returncode == 2 and "runs with WORLD_SIZE=1" in done.stderr for done in runs)


def test_a_rank_whose_peer_vanishes_mid_training_exits_as_a_link_failure(home: Path, small_seed: Seed) -> None:
    """Rank 1 is killed after its first updates: rank 0's collective breaks, and it exits EXIT_LINK with the reason,
    which the agent reports as lost (retried), not as a failure of the run."""
    port = free_port()
    args = [sys.executable, "-m", "experiment.cli", "train", "--home", str(home), "--model-dir", str(small_seed[0])]
    ranks = [
        subprocess.Popen(
            [*args, "--arm", "clean-pair"],
            env=rank_env(rank, 2, port),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        assert ranks[1].stdout is not None
        for line in ranks[1].stdout:
            if json.loads(line).get("event") == "step":
                break  # it trains: now its host vanishes
        ranks[1].kill()
        _out, err = ranks[0].communicate(timeout=120)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.communicate()
    assert ranks[0].returncode == EXIT_LINK, err[-2000:]
    assert "rank 0 of clean-pair: the gang's communication broke" in err


def test_ranks_with_different_bindings_both_abort(home: Path, small_seed: Seed, tmp_path: Path) -> None:
    plan_path = write_plan(tmp_path / "other.toml", small_seed[1], test=24)
    corpus.prepare(load_plan(plan_path), plan_path, tmp_path / "other", small_seed[0], None, lambda event: None)
    same = _fresh_home(home, tmp_path / "same")
    port = free_port()
    args = [sys.executable, "-m", "experiment.cli", "train", "--model-dir", str(small_seed[0]), "--arm", "clean-pair"]
    processes = [
        subprocess.Popen(
            [*args, "--home", str(h)],
            env=rank_env(rank, 2, port),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, h in enumerate((same, tmp_path / "other"))
    ]
    for process in processes:
        _out, err = process.communicate(timeout=300)
        assert process.returncode == 2
        assert "ranks disagree on the binding" in err


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("checkpoints/step-000002/model/model.safetensors", "model.safetensors does not match its receipt"),
        ("checkpoints/step-000002/optimizer.pt", "optimizer.pt does not match its receipt"),
        ("checkpoints/step-000002/receipt.json", r"receipt .*receipt\.json does not match the sha256"),
        ("pointers/step-000002.json", r"pointers/step-000002\.json( is malformed| is not valid JSON| records)"),
    ],
)
def test_tampered_checkpoint_is_refused(
    home: Path, small_seed: Seed, tmp_path: Path, target: str, message: str
) -> None:
    broken = _fresh_home(home, tmp_path)
    [stopped] = coop_train(broken, small_seed[0], "clean-single", 1, "--stop-after", "3")
    assert stopped.returncode == 0, stopped.stderr
    path = training.run_dir(broken, "clean-single", 0) / target
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    [resumed] = coop_train(broken, small_seed[0], "clean-single", 1)
    assert resumed.returncode == 2

    assert re.search(message, resumed.stderr), resumed.stderr


def test_a_changed_checkpoint_a_kill_left_without_its_pointer_is_refused(
    stopped: Path, small_seed: Seed, tmp_path: Path
) -> None:
    broken = _copy(stopped, tmp_path)
    run = training.run_dir(broken, "clean-single", 0)
    (run / "pointers" / "step-000002.json").unlink()
    changed = run / "checkpoints" / "step-000002" / "optimizer.pt"
    data = bytearray(changed.read_bytes())
    data[len(data) // 2] ^= 0x01
    changed.write_bytes(bytes(data))
    [refused] = coop_train(broken, small_seed[0], "clean-single", 1)
    assert refused.returncode == 2
    assert "optimizer.pt does not match its receipt" in refused.stderr, refused.stderr
    # Nothing vouches for it now either: no pointer was written, and the folder is kept as it is.
    assert not (run / "pointers" / "step-000002.json").exists()
    assert changed.read_bytes() == bytes(data)


def test_a_checkpoint_stores_the_seeds_tensors_under_the_seeds_names(stopped: Path, small_seed: Seed) -> None:
    seed_weights = small_seed[0] / "model.safetensors"
    run = training.run_dir(stopped, "clean-single", 0)
    weights = run / "checkpoints" / "step-000002" / "model" / "model.safetensors"
    # The seed ties its output layer to its embedding and stores the pair once, as model.embed_tokens.weight.
    assert "model.embed_tokens.weight" in seedmodel.safetensors_layout(seed_weights)
    assert "lm_head.weight" not in seedmodel.safetensors_layout(seed_weights)
    assert seedmodel.safetensors_layout(weights) == seedmodel.safetensors_layout(seed_weights)
    stored, seed = load_file(str(weights)), load_file(str(seed_weights))
    model = seedmodel.load_model(weights.parent)
    # The file holds the trained weights (not the seed's), and the loaded model's output layer is that embedding.
    assert not torch.equal(stored["model.embed_tokens.weight"], seed["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, stored["model.embed_tokens.weight"])
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"])


def _rewrite_weights(run: Path, step: str, change: str) -> None:
    """Rewrite a checkpoint's weights as a writer that ignored the seed's layout would have, with a receipt and a
    pointer that vouch for them: only the layout check can tell."""
    folder = run / "checkpoints" / step
    weights = folder / "model" / "model.safetensors"
    tensors = load_file(str(weights))
    if change == "renamed":  # the tied pair stored under the other name, as safetensors' save_model does
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    else:
        del tensors["model.norm.weight"]
    weights.unlink()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    receipt = json.loads((folder / "receipt.json").read_bytes())
    receipt["files"]["model/model.safetensors"] = sha256_file(weights)
    (folder / "receipt.json").write_bytes(canonical_bytes(receipt) + b"\n")
    pointer_path = run / "pointers" / f"{step}.json"
    pointer = json.loads(pointer_path.read_bytes())
    pointer["receipt_sha256"] = sha256_file(folder / "receipt.json")
    pointer_path.write_bytes(canonical_bytes(pointer) + b"\n")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("renamed", "missing model.embed_tokens.weight; extra lm_head.weight"),
        ("missing", "missing model.norm.weight"),
    ],
)
def test_a_checkpoint_not_in_the_seeds_layout_is_refused_and_named(
    stopped: Path, small_seed: Seed, tmp_path: Path, change: str, message: str
) -> None:
    broken = _copy(stopped, tmp_path)
    run = training.run_dir(broken, "clean-single", 0)
    _rewrite_weights(run, "step-000002", change)
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    [refused] = coop_train(broken, small_seed[0], "clean-single", 1)
    assert refused.returncode == 2
    assert "not in the seed's tensor layout" in refused.stderr and message in refused.stderr, refused.stderr
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before  # nothing written
