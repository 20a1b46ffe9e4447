"""Evaluation, selection and the offline report, on a complete bundle made by the real commands."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from experiment.core import ledger, tasks
from experiment.core.canonical import canonical_bytes, sha256_file
from experiment.core.errors import CoopError
from experiment.core.plan import load_plan
from experiment.learning import corpus, decoding, evaluation, selection
from experiment.report import bundle, recompute
from experiment.seed import seedmodel, seedtokenizer
from tests.conftest import write_plan
from tests.support.greedy import hf_greedy, hf_model
from tests.support.processes import coop_train

Seed = tuple[Path, seedmodel.Snapshot]
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "seeds" / "tiny"


def _train(home: Path, seed: Path, arm: str, world: int) -> None:
    for done in coop_train(home, seed, arm, world):
        assert done.returncode == 0, done.stderr


def _quiet(event: dict[str, object]) -> None:
    del event


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, small_seed: Seed) -> Path:
    """A home with the three arms trained (the pair as two real processes) on the small plan."""
    folder = tmp_path_factory.mktemp("trained")
    plan_path = write_plan(folder / "plan.toml", small_seed[1])
    home = folder / "home"
    corpus.prepare(load_plan(plan_path), plan_path, home, small_seed[0], None, _quiet)
    _train(home, small_seed[0], "clean-single", 1)
    _train(home, small_seed[0], "damaged-single", 1)
    _train(home, small_seed[0], "clean-pair", 2)
    return home


@pytest.fixture(scope="module")
def evidence(trained: Path, small_seed: Seed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The complete evidence bundle: selection, four test evaluations, exported."""
    home = tmp_path_factory.mktemp("evaluated") / "home"
    shutil.copytree(trained, home)
    _chosen, path = selection.select(corpus.load_prepared(home), small_seed[0])
    for arm in corpus.load_prepared(home).plan.arm_names():
        evaluation.evaluate(home, small_seed[0], arm, "test", path, _quiet)
    out = tmp_path_factory.mktemp("bundle") / "bundle"
    bundle.export_bundle(home, small_seed[0], out)
    return out


def _rows_leaving(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(rows in the batch, rows that leave it) each time rows leave a batch while others decode on."""
    seen: list[tuple[int, int]] = []
    leave = decoding._Batch.leave

    def spied(batch: Any, ended: torch.Tensor) -> torch.Tensor:
        seen.append((len(ended), int(ended.sum())))
        return leave(batch, ended)

    monkeypatch.setattr(decoding._Batch, "leave", spied)
    return seen


@pytest.mark.usefixtures("one_thread")
def test_batched_generation_equals_hf_generate_one_prompt_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TINY.is_dir(), f"{TINY} is missing: it is committed in the repository (git checkout seeds/)"
    tokenizer = seedtokenizer.read_tokenizer(TINY)
    model = seedmodel.load_model(TINY).eval()
    prompts = [
        corpus.prompt_ids(tokenizer, tasks.render_prompt(tasks.make_case(2026091301, "test", i))) for i in range(72)
    ]
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    assert len({len(p) for p in prompts}) >= 8  # mixed lengths: every batch is padded
    left = _rows_leaving(monkeypatch)
    # 72 prompts in three batches of 24, each prefilled in two groups of its own width (16 and 8 prompts).
    assert decoding.PREFILL_ROWS == 16
    batched = decoding.generate(model, prompts, eos, pad, 96, batch_size=24)
    truth = hf_model(TINY)
    reference = [hf_greedy(truth, p, eos, pad, 96) for p in prompts]
    assert [g.output_ids for g in batched] == reference
    for generation, ids in zip(batched, reference, strict=True):
        assert generation.ended_with_eos == (ids[-1] == eos)
        assert generation.hit_token_limit == (ids[-1] != eos and len(ids) == 96)
    assert any(g.ended_with_eos for g in batched) and any(g.hit_token_limit for g in batched)
    assert left and all(0 < leaving < rows for rows, leaving in left)  # rows left while others decoded on


@pytest.mark.usefixtures("one_thread")
def test_bfloat16_numerics_answer_as_hf_generate_does_in_bfloat16() -> None:
    """The numerics a GPU plan answers in: every weight in bfloat16, the batched answers transformers' own generate's
    of the same bfloat16 model, and not the float32 model's answers (the numerics change what the model says)."""
    tokenizer = seedtokenizer.read_tokenizer(TINY)
    model = evaluation.answering_model(seedmodel.load_model(TINY), "cpu", "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prompts = [
        corpus.prompt_ids(tokenizer, tasks.render_prompt(tasks.make_case(2026091301, "test", i))) for i in range(32)
    ]
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    batched = [g.output_ids for g in decoding.generate(model, prompts, eos, pad, 96, batch_size=16)]
    truth = hf_model(TINY, torch.bfloat16)
    assert batched == [hf_greedy(truth, p, eos, pad, 96) for p in prompts]
    in_float32 = evaluation.answering_model(seedmodel.load_model(TINY), "cpu", "float32")
    assert batched != [g.output_ids for g in decoding.generate(in_float32, prompts, eos, pad, 96, batch_size=16)]


def test_test_evaluation_refused_before_selection(trained: Path, small_seed: Seed) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiment.cli",
            "evaluate",
            "--home",
            str(trained),
            "--model-dir",
            str(small_seed[0]),
            "--arm",
            "clean-single",
            "--role",
            "test",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 2
    assert "needs --selection" in done.stderr
    assert not (trained / "evaluations" / "test").exists()


def test_selection_takes_only_final_verified_checkpoints(trained: Path, small_seed: Seed, tmp_path: Path) -> None:
    home = tmp_path / "home"
    shutil.copytree(trained, home)
    chosen, _ = selection.select(corpus.load_prepared(home), small_seed[0])
    final = corpus.load_prepared(home).plan.training.updates
    assert {c.step for arm, c in chosen.arms.items() if arm != "seed"} == {final}
    weights = home / "runs" / "damaged-single" / "rank-0" / "checkpoints" / f"step-{final:06d}" / "model"
    with (weights / "model.safetensors").open("r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        handle.write(b"\x00")
    with pytest.raises(CoopError, match=r"model\.safetensors does not match"):
        selection.candidate_for(corpus.load_prepared(home), "damaged-single", small_seed[0])


def test_interrupted_evaluation_restarts_only_by_reproducing_its_answers(
    trained: Path, small_seed: Seed, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    shutil.copytree(trained, home)
    # Interrupted after its first chunk: CHUNK_BATCHES batches of one prompt, of the 8 dev tasks.
    chunk = evaluation.CHUNK_BATCHES
    assert chunk < 8
    assert (
        evaluation.evaluate(home, small_seed[0], "clean-single", "dev", None, _quiet, stop_after=chunk, batch_size=1)
        is None
    )
    answers = evaluation.evaluation_dir(home, "dev", "clean-single") / "answers.jsonl"
    assert len(answers.read_bytes().splitlines()) == chunk
    spoiled = tmp_path / "spoiled"
    shutil.copytree(home, spoiled)
    # Restarted in batches of 4: the batched answers reproduce those made one prompt at a time.
    summary = evaluation.evaluate(home, small_seed[0], "clean-single", "dev", None, _quiet, batch_size=4)
    assert summary is not None and summary.answers == 8
    folder = evaluation.evaluation_dir(home, "dev", "clean-single")
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    # Run again (a retry of an attempt lost after it finished): the same summary, reported again; nothing written.
    events: list[dict[str, object]] = []
    assert evaluation.evaluate(home, small_seed[0], "clean-single", "dev", None, events.append) == summary
    assert [e["event"] for e in events] == ["evaluated"] and events[0]["answers"] == 8
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    # A finished evaluation of another model where the seed's would go is refused, not reported as the seed's.
    shutil.copytree(folder, evaluation.evaluation_dir(home, "dev", "seed"))
    with pytest.raises(CoopError, match="finished evaluation of other inputs, model or selection"):
        evaluation.evaluate(home, small_seed[0], "seed", "dev", None, _quiet, batch_size=4)

    path = evaluation.evaluation_dir(spoiled, "dev", "clean-single") / "answers.jsonl"
    lines = path.read_bytes().splitlines()
    second = json.loads(lines[1])
    second["output_ids"] = [*second["output_ids"], 0]
    lines[1] = canonical_bytes(second)
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(CoopError, match=f"does not reproduce the recorded answer to task {second['id']}"):
        evaluation.evaluate(spoiled, small_seed[0], "clean-single", "dev", None, _quiet, batch_size=4)


def test_report_recomputes_the_verdict_from_the_bundle(evidence: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiment.cli",
            "report",
            "--home",
            str(evidence),
            "--output",
            str(tmp_path / "report.json"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    event = json.loads(done.stdout.splitlines()[-1])
    assert set(event["conditions"]) == {
        "gain >= min_gain",
        "p_value <= max_p_value",
        "retention upper bound <= max_retention_upper_nats",
    }
    written = json.loads((tmp_path / "report.json").read_text())
    seed_correct = written["accuracy"]["seed"]["overall"]["correct"]
    answers = evaluation.read_answers(evidence / "evaluations" / "test" / "seed")[1]
    assert seed_correct == sum(a.check.correct for a in answers)
    assert written["primary"]["verdict"]["passed"] == event["passed"]
    html = (tmp_path / "report.html").read_text()
    assert "<svg" in html and "Primary contract" in html


def _rehash_evaluation(folder: Path) -> None:
    summary = json.loads((folder / "evaluation.json").read_text())
    summary["answers_sha256"] = sha256_file(folder / "answers.jsonl")
    (folder / "evaluation.json").write_bytes(canonical_bytes(summary) + b"\n")


def _edit_jsonl(path: Path, line: int, change: Callable[[dict[str, object]], None]) -> None:
    lines = path.read_bytes().splitlines()
    record = json.loads(lines[line])
    change(record)
    lines[line] = canonical_bytes(record)
    path.write_bytes(b"\n".join(lines) + b"\n")


def _edit_json(path: Path, change: Callable[[dict[str, object]], None]) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_bytes(canonical_bytes(record) + b"\n")


def _flip_check(bundle_dir: Path) -> None:
    folder = bundle_dir / "evaluations" / "test" / "clean-single"
    _edit_jsonl(
        folder / "answers.jsonl",
        3,
        lambda r: r.update(check={"correct": True, "reason": "correct", "valid_json_object": True}),
    )
    _rehash_evaluation(folder)


def _change_text(bundle_dir: Path) -> None:
    folder = bundle_dir / "evaluations" / "test" / "seed"
    _edit_jsonl(folder / "answers.jsonl", 0, lambda r: r.update(text=str(r["text"]) + " "))
    _rehash_evaluation(folder)


def _flip_answer_byte(bundle_dir: Path) -> None:
    path = bundle_dir / "evaluations" / "test" / "clean-pair" / "answers.jsonl"
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))


def _swap_journal(bundle_dir: Path) -> None:
    def swap(result: dict[str, object]) -> None:
        journal = result["journal"]
        assert isinstance(journal, list)
        journal[0]["positions"] = list(reversed(journal[0]["positions"]))

    _edit_json(bundle_dir / "runs" / "clean-single" / "rank-0" / "result.json", swap)


def _rank_digest(bundle_dir: Path) -> None:
    _edit_json(
        bundle_dir / "runs" / "clean-pair" / "rank-1" / "result.json", lambda r: r.update(parameter_digest="0" * 64)
    )


def _damaged_ids(bundle_dir: Path) -> None:
    _edit_json(bundle_dir / "prepared" / "manifest.json", lambda m: m.update(damaged_ids=list(m["damaged_ids"])[1:]))  # type: ignore[call-overload]


def _regenerated_prompt(bundle_dir: Path) -> None:
    path = bundle_dir / "prepared" / "test.jsonl"
    _edit_jsonl(path, 5, lambda r: r.update(prompt=str(r["prompt"]) + " "))
    _edit_json(bundle_dir / "prepared" / "manifest.json", lambda m: m["roles"]["test"].update(sha256=sha256_file(path)))  # type: ignore[index]


def _seed_file(bundle_dir: Path) -> None:
    with (bundle_dir / "seed" / "tokenizer_config.json").open("a") as handle:
        handle.write("\n")


def _selection_candidate(bundle_dir: Path) -> None:
    _edit_json(bundle_dir / "selection.json", lambda s: s["arms"]["clean-single"].update(model_identity="f" * 64))  # type: ignore[index]


def _evaluation_selection(bundle_dir: Path) -> None:
    _edit_json(
        bundle_dir / "evaluations" / "test" / "damaged-single" / "evaluation.json",
        lambda s: s.update(selection_identity="e" * 64),
    )


def _evaluation_numerics(bundle_dir: Path) -> None:
    _edit_json(
        bundle_dir / "evaluations" / "test" / "seed" / "evaluation.json", lambda s: s.update(numerics="bfloat16")
    )


@pytest.mark.parametrize(
    ("tamper", "names"),
    [
        (_flip_check, r"clean-single/answers\.jsonl: line 4\.check"),
        (_change_text, r"seed/answers\.jsonl: line 1\.text"),
        (_flip_answer_byte, r"clean-pair/answers\.jsonl does not match the sha256"),
        (_swap_journal, r"clean-single/rank-0/result\.json: journal\[1\]\.positions"),
        (_rank_digest, r"clean-pair/rank-1/result\.json: parameter_digest"),
        (_damaged_ids, r"manifest\.json: damaged_ids"),
        (_regenerated_prompt, r"test\.jsonl: line 6\.prompt"),
        (_seed_file, r"seed/tokenizer_config\.json: sha256"),
        (_selection_candidate, r"clean-single/rank-0/result\.json: parameter_digest"),
        (_evaluation_selection, r"damaged-single/evaluation\.json: selection_identity"),
        (_evaluation_numerics, r"test/seed/evaluation\.json: numerics"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[1:] if callable(value) else "",
)
def test_report_refuses_tampered_evidence_naming_it(
    evidence: Path, tmp_path: Path, tamper: Callable[[Path], None], names: str
) -> None:
    copy = tmp_path / "bundle"
    shutil.copytree(evidence, copy)
    tamper(copy)
    with pytest.raises(CoopError, match=names):
        recompute.write_report(copy, tmp_path / "out" / "report.json")
    assert not (tmp_path / "out").exists()


def _with_ledger(bundle_dir: Path) -> list[ledger.Entry]:
    manifest = json.loads((bundle_dir / "prepared" / "manifest.json").read_text())
    chosen = selection.read_selection(bundle_dir / "selection.json")
    entries: list[ledger.Entry] = []
    for kind, identity in (
        ("plan", manifest["plan_identity"]),
        ("prepared", corpus.prepared_identity(manifest)),
        ("selection", selection.selection_identity(chosen)),
    ):
        entries.append(ledger.next_entry(entries[-1] if entries else None, kind, identity, {}))
    (bundle_dir / "ledger.json").write_bytes(msgspec.json.encode(entries))
    return entries


def test_report_verifies_the_ledger_and_its_commitments(evidence: Path, tmp_path: Path) -> None:
    copy = tmp_path / "bundle"
    shutil.copytree(evidence, copy)
    entries = _with_ledger(copy)
    assert recompute.compute(copy).ledger_entries == 3
    altered = [*entries[:1], msgspec.structs.replace(entries[1], body={"changed": True}), *entries[2:]]
    (copy / "ledger.json").write_bytes(msgspec.json.encode(altered))
    with pytest.raises(CoopError, match="ledger seq 2: hash does not match"):
        recompute.compute(copy)
    wrong = [ledger.next_entry(None, "plan", "a" * 64, {})]
    (copy / "ledger.json").write_bytes(msgspec.json.encode(wrong))
    with pytest.raises(CoopError, match=r"ledger\.json: seq 1\.identity"):
        recompute.compute(copy)


def test_bundle_holds_no_weights(evidence: Path) -> None:
    assert not list(evidence.rglob("*.safetensors")) and not list(evidence.rglob("*.pt"))
    manifest = msgspec.json.decode((evidence / "prepared" / "manifest.json").read_bytes())
    assert manifest["plan"] == "small"


def _rerun(bundle_dir: Path, seed: Path, work: Path, updates: int = 2) -> dict[str, Any]:
    """`coop rerun` of clean-single's first ``updates`` updates from ``bundle_dir``; its written verdict."""
    argv = [sys.executable, "-m", "experiment.cli", "rerun", "--bundle", str(bundle_dir), "--model-dir", str(seed)]
    argv += ["--arm", "clean-single", "--updates", str(updates), "--work", str(work), "--out", str(work / "rerun.json")]
    done = subprocess.run(
        argv, capture_output=True, text=True, cwd=ROOT, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["done"] for e in printed if e["event"] == "rerun-step"] == list(range(1, updates + 1))  # progress
    found: dict[str, Any] = json.loads((work / "rerun.json").read_text())
    assert printed[-1]["verdict"] == found["verdict"]
    return found


def _journal_edit(bundle_dir: Path, tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(bundle_dir, copy)
    path = copy / "runs" / "clean-single" / "rank-0" / "result.json"
    result = json.loads(path.read_text())
    change(result)
    path.write_text(json.dumps(result))
    return copy


def test_a_rerun_on_the_same_profile_reproduces_the_bundles_updates_bit_for_bit(
    evidence: Path, small_seed: Seed, tmp_path: Path
) -> None:
    found = _rerun(evidence, small_seed[0], tmp_path / "rerun")
    assert found["verdict"] == "identical" and found["profile_fields"] == []
    assert found["first_difference"] is None and found["largest_relative_difference"] == 0.0
    # The profile names the machine the digests hold for: this CPU, its instruction sets and math libraries.
    assert found["rerun_profile"]["cpu_model"] and found["rerun_profile"]["cpu_capability"]
    assert found["rerun_profile"]["blas"] == "mkl" and found["rerun_profile"]["onednn"].startswith("v")


def test_a_journal_loss_one_ulp_off_is_a_divergence_at_its_update(
    evidence: Path, small_seed: Seed, tmp_path: Path
) -> None:
    def nudge(result: dict[str, Any]) -> None:
        result["journal"][1]["loss"] = math.nextafter(result["journal"][1]["loss"], math.inf)

    found = _rerun(_journal_edit(evidence, tmp_path, nudge), small_seed[0], tmp_path / "rerun")
    assert found["verdict"] == "diverged" and found["profile_fields"] == []
    first = found["first_difference"]
    assert (first["step"], first["rank"], first["field"]) == (2, 0, "loss")
    assert first["bundle"] == math.nextafter(first["rerun"], math.inf)
    assert 0 < found["largest_relative_difference"] < 1e-15


def test_a_bundle_from_another_cpu_is_a_different_profile_naming_the_field(
    evidence: Path, small_seed: Seed, tmp_path: Path
) -> None:
    def elsewhere(result: dict[str, Any]) -> None:
        result["numerical_profile"]["cpu_model"] = "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"

    found = _rerun(_journal_edit(evidence, tmp_path, elsewhere), small_seed[0], tmp_path / "rerun")
    assert found["verdict"] == "different-profile" and found["profile_fields"] == ["cpu_model"]
    assert (
        found["largest_relative_difference"] == 0.0
    )  # the numbers still agree here: the verdict says why not trust it
