"""The tiny local seed: deterministic builds, ChatML tokenizer, and verification that refuses any difference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from experiment.errors import CoopError
from experiment.seedmodel import (
    EOS_TOKEN,
    PAD_TOKEN,
    SMALL,
    Snapshot,
    build_seed,
    count_parameters,
    load_model,
    load_tokenizer,
    snapshot_of,
    synthetic_conversation,
    verify_seed,
)
from experiment.tasks import make_case, render_prompt

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Snapshot]:
    out = tmp_path_factory.mktemp("seed") / "small"
    events: list[dict[str, object]] = []
    snapshot = build_seed(out, SMALL, events.append, root=ROOT)
    assert [e["step"] for e in events if e["event"] == "pretrain"] == list(range(1, SMALL.pretrain_steps + 1))
    return out, snapshot


@pytest.fixture()
def seed_copy(built: tuple[Path, Snapshot], tmp_path: Path) -> Path:
    copy = tmp_path / "seed"
    shutil.copytree(built[0], copy)
    return copy


def test_two_builds_of_small_are_byte_identical(built: tuple[Path, Snapshot], tmp_path: Path) -> None:
    again = build_seed(tmp_path / "again", SMALL, root=ROOT)
    assert again == built[1]
    for name in built[1].files:
        assert (tmp_path / "again" / name).read_bytes() == (built[0] / name).read_bytes()


def test_snapshot_lists_model_tokenizer_and_generation_files(built: tuple[Path, Snapshot]) -> None:
    out, snapshot = built
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(snapshot.files)
    assert snapshot == snapshot_of(out)
    assert snapshot.parameters == count_parameters(out) == load_model(out).num_parameters()


def test_tokenizer_splits_digits_one_per_token(built: tuple[Path, Snapshot]) -> None:
    tokenizer = load_tokenizer(built[0])
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("id=J327 units=1905", add_special_tokens=False))
    digits = [t for t in tokens if any(ch.isdigit() for ch in t)]
    assert digits == ["3", "2", "7", "1", "9", "0", "5"]


def test_chat_template_renders_chatml_and_ends_with_the_generation_prompt(built: tuple[Path, Snapshot]) -> None:
    tokenizer = load_tokenizer(built[0])
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_and_generation_stop_at_im_end_and_pad_with_endoftext(built: tuple[Path, Snapshot]) -> None:
    tokenizer = load_tokenizer(built[0])
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token == PAD_TOKEN
    assert len(tokenizer.encode("<|im_start|><|im_end|><|endoftext|>", add_special_tokens=False)) == 3
    generation = json.loads((built[0] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert generation.get("do_sample", False) is False


def test_verify_passes_on_a_fresh_build(built: tuple[Path, Snapshot]) -> None:
    verify_seed(built[0], built[1])


def test_verify_refuses_a_changed_byte_in_the_weights(seed_copy: Path, built: tuple[Path, Snapshot]) -> None:
    weights = seed_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # the last byte is tensor data, so the file still parses
    weights.write_bytes(bytes(data))
    with pytest.raises(CoopError, match=r"model\.safetensors has sha256"):
        verify_seed(seed_copy, built[1])


def test_verify_refuses_a_missing_file(seed_copy: Path, built: tuple[Path, Snapshot]) -> None:
    (seed_copy / "tokenizer.json").unlink()
    with pytest.raises(CoopError, match=r"tokenizer\.json is missing"):
        verify_seed(seed_copy, built[1])


def test_verify_refuses_an_extra_file(seed_copy: Path, built: tuple[Path, Snapshot]) -> None:
    (seed_copy / "notes.txt").write_text("not part of the seed\n")
    with pytest.raises(CoopError, match=r"notes\.txt is not in the snapshot"):
        verify_seed(seed_copy, built[1])


def test_verify_refuses_another_parameter_count(built: tuple[Path, Snapshot]) -> None:
    wrong = Snapshot(built[1].files, built[1].tokenizer_identity, built[1].parameters + 1)
    with pytest.raises(CoopError, match="parameters"):
        verify_seed(built[0], wrong)


def test_build_refuses_a_non_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("x")
    with pytest.raises(CoopError, match="not empty"):
        build_seed(tmp_path, SMALL, root=ROOT)
    assert [p.name for p in tmp_path.iterdir()] == ["something"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA refuses a CUDA build")
def test_a_cuda_build_without_cuda_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    out = tmp_path / "seed"
    with pytest.raises(CoopError, match="asks for cuda, and no CUDA device is visible"):
        build_seed(out, msgspec.structs.replace(SMALL, device="cuda"), root=ROOT)
    assert not out.exists()


def test_pretraining_answers_never_use_the_task_schemas() -> None:
    task_keys = [{"city", "units"}, {"ids"}, {"total"}]
    prompts = {render_prompt(make_case(2026091301, role, i)) for role in ("train", "test") for i in range(64)}
    for index in range(400):
        for message in synthetic_conversation(index):
            assert message["content"] not in prompts
            if message["role"] != "assistant" or not message["content"].startswith("{"):
                continue
            assert set(json.loads(message["content"])) not in task_keys


def test_pretraining_pool_covers_every_family_shape() -> None:
    # The seed must have seen lookups, selections, rankings and sums, in prose and in its own JSON keys.
    answers = [m["content"] for i in range(200) for m in synthetic_conversation(i) if m["role"] == "assistant"]
    joined = "\n".join(answers)
    for marker in ('"location"', '"matches"', '"best"', '"sum"', "Record ", "Matching "):
        assert marker in joined
