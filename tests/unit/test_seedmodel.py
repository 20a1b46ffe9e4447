"""The tiny local seed: deterministic builds, ChatML tokenizer, and verification that refuses any difference."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from experiment.core.errors import CoopError
from experiment.core.plan import load_plan
from experiment.core.tasks import make_case, render_prompt
from experiment.learning.corpus import seed_snapshot
from experiment.seed.seedmodel import (
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    Snapshot,
    count_parameters,
    load_model,
    load_tokenizer,
    snapshot_of,
    verify_seed,
)
from experiment.seed.tinyseed import (
    COPY_PROBES,
    FULL,
    IGNORE,
    SMALL,
    SeedConfig,
    _repeated_sequence,
    build_seed,
    copied,
    copy_probes,
    encoder_of,
    synthetic_conversation,
)
from tests.support.greedy import hf_model

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
    assert snapshot.parameters == count_parameters(out) == sum(p.numel() for p in load_model(out).parameters())


def _tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> list[str]:
    return [str(t) for t in tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))]


def test_an_id_is_the_same_tokens_in_a_table_a_question_and_an_answer(built: tuple[Path, Snapshot]) -> None:
    tokenizer = load_tokenizer(built[0])
    table, question, answer = (
        _tokens(tokenizer, text) for text in ("id=J327 units=19", "What about J327?", '{"id": "J327"}')
    )
    start = table.index("J")
    id_tokens = table[start : next(i for i in range(start, len(table)) if table[i].startswith("Ġ"))]
    assert "".join(id_tokens) == "J327"
    for tokens in (question, answer):
        at = tokens.index("J")
        assert tokens[at : at + len(id_tokens)] == id_tokens


def test_the_committed_seed_is_the_one_the_local_plan_pins() -> None:
    verify_seed(ROOT / "seeds" / "tiny", seed_snapshot(load_plan(ROOT / "plans" / "local.toml")))


def test_the_committed_seed_keeps_an_ids_number_and_each_table_value_one_token() -> None:
    tokenizer = load_tokenizer(ROOT / "seeds" / "tiny")
    assert _tokens(tokenizer, "id=J327 city=Oslo units=19") == ["id", "=", "J", "327", "Ġcity=Oslo", "Ġunits=19"]
    for number in range(100, 1000):
        assert _tokens(tokenizer, f"What about J{number}?")[-3:] == ["J", str(number), "?"]


def test_digits_outside_a_table_value_go_in_groups_of_at_most_three(built: tuple[Path, Snapshot]) -> None:
    tokens = _tokens(load_tokenizer(built[0]), "J327 total=123456")
    with_digits = [t for t in tokens if any(ch.isdigit() for ch in t)]
    assert "".join(with_digits) == "327123456"
    assert all(t.isdigit() and len(t) <= 3 for t in with_digits)


def test_repeated_sequences_label_only_the_repeat() -> None:
    ids, labels = _repeated_sequence(random.Random(1), 400)
    half = len(ids) // 2
    assert ids[:half] == ids[half:] and 8 <= half <= 40
    assert labels == [IGNORE] * half + ids[half:]
    assert all(len(SPECIAL_TOKENS) <= token < 400 for token in ids)


def _rows(text: str) -> dict[str, dict[str, str]]:
    """The table rows (lines starting with ``id=``) in a message, by id."""
    rows = {}
    for line in text.splitlines():
        if not line.startswith("id="):
            continue
        fields = dict(item.split("=", 1) for item in line.split(" "))
        rows[fields.pop("id")] = fields
    return rows


def _subsequence(values: list[str], of: list[str]) -> bool:
    remaining = iter(of)
    return all(value in remaining for value in values)


def test_pretraining_lookups_answer_from_the_table_they_show() -> None:
    checked = 0
    for index in range(300):
        messages = synthetic_conversation(index, SMALL)
        rows = _rows(messages[0]["content"])
        for message in messages[1::2]:
            content = message["content"]
            if content.startswith('{"id": '):  # a lookup that names the id first
                answer = json.loads(content)
                if answer.get("found") is False:
                    assert answer["id"] not in rows
                    continue
                row = rows[answer["id"]]
                assert all(
                    row[field] == str(answer[key])
                    for field, key in (("city", "location"), ("units", "count"))
                    if key in answer
                )
                checked += 1
            elif content.startswith("id="):  # a quoted row, or the whole table
                assert all(rows[rid] == fields for rid, fields in _rows(content).items())
                checked += 1
            elif all(re.fullmatch(r"[A-Z][0-9]{3}( [A-Za-z0-9]+)+", line) for line in content.splitlines()):
                for line in content.splitlines():  # rows' values: an id, then its values
                    rid, *values = line.split(" ")
                    assert values and _subsequence(values, list(rows[rid].values()))
                checked += 1
    assert checked > 100


def test_the_committed_pool_asks_one_lookup_or_rows_values_of_a_table_shown_first() -> None:
    kinds = set()
    for index in range(300):
        user, assistant = synthetic_conversation(index, FULL)
        assert user["content"].startswith("Table:\nid=")
        answer = assistant["content"]
        if answer.startswith("{"):
            keys = set(json.loads(answer))
            assert keys == {"id", "found"} or keys <= {"location", "count", "cost", "state", "rank"}
            kinds.add("lookup")
        else:
            rows = _rows(user["content"])
            assert all(line.split(" ")[0] in rows for line in answer.splitlines())
            kinds.add("values")
    assert kinds == {"lookup", "values"}


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


@pytest.mark.parametrize("config", [FULL, SMALL], ids=["full", "small"])
def test_pretraining_answers_never_use_the_task_schemas(config: SeedConfig) -> None:
    task_keys = [{"city", "units"}, {"ids"}, {"total"}]
    prompts = {render_prompt(make_case(2026091301, role, i)) for role in ("train", "test") for i in range(64)}
    for index in range(400):
        for message in synthetic_conversation(index, config):
            assert message["content"] not in prompts
            if message["role"] != "assistant" or not message["content"].startswith("{"):
                continue
            assert set(json.loads(message["content"])) not in task_keys


def test_the_small_pool_holds_both_kinds_in_prose_and_in_json() -> None:
    # Lookups in the seed's own JSON keys and in prose, absent ids, and rows' values.
    answers = [m["content"] for i in range(200) for m in synthetic_conversation(i, SMALL) if m["role"] == "assistant"]
    joined = "\n".join(answers)
    for marker in ('"location"', '"found": false', "Record ", "is not in the table"):
        assert marker in joined
    assert any(re.fullmatch(r"[A-Z][0-9]{3}( [A-Za-z0-9]+)+", answer.splitlines()[0]) for answer in answers)


def test_copy_probes_ask_for_an_id_the_table_holds_in_the_seeds_own_schema(built: tuple[Path, Snapshot]) -> None:
    tokenizer = load_tokenizer(built[0])
    probes = copy_probes(encoder_of(tokenizer))
    assert {style: len(rows) for style, rows in probes.items()} == {"plain": COPY_PROBES, "with_id": COPY_PROBES}
    for ids, labels in probes["with_id"][:16]:
        text = tokenizer.decode(ids)
        answer = json.loads(tokenizer.decode([t for t in labels if t != IGNORE], skip_special_tokens=True))
        assert set(answer) == {"id", "location", "count"}
        assert f"id={answer['id']} city={answer['location']} units={answer['count']}" in text


def test_a_probe_counts_as_copied_only_when_every_answer_token_is_the_greedy_one(
    built: tuple[Path, Snapshot],
) -> None:
    tokenizer = load_tokenizer(built[0])
    model = hf_model(built[0])  # the model tinyseed's pretraining probes: transformers'
    ids, labels = copy_probes(encoder_of(tokenizer))["plain"][0]
    prompt = ids[: next(i for i, label in enumerate(labels) if label != IGNORE)]
    greedy: list[int] = []
    with torch.no_grad():  # greedy decoding, one argmax after another
        for _ in range(6):
            greedy.append(int(model(torch.tensor([prompt + greedy])).logits[0, -1].argmax()))
    own = (prompt + greedy, [IGNORE] * len(prompt) + greedy)
    other = [*greedy[:-1], (greedy[-1] + 1) % len(tokenizer)]
    pad = int(tokenizer.pad_token_id)
    assert copied(model, [own], pad) == 1
    assert copied(model, [(prompt + other, [IGNORE] * len(prompt) + other)], pad) == 0
    assert not model.training  # the probe leaves the model in the mode it found it
