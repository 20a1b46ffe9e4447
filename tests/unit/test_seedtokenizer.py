"""The seed tokenizer read without transformers (experiment.seed.seedtokenizer) is transformers' own, for both
committed seeds: the same identity as the plans record, the same rendered prompts, token ids, offsets and decodings,
and the same prepared files as the committed SmolLM2 run's. A tokenizer transformers rebuilds (a hub folder's
GPT2Tokenizer) is read through transformers."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import msgspec
import pytest

from experiment.core.canonical import sha256_bytes
from experiment.core.plan import load_plan
from experiment.learning import corpus
from experiment.learning.records import Manifest
from experiment.seed import seedtokenizer
from experiment.seed.seedtokenizer import SeedTokenizer, read_tokenizer, tokenizer_identity
from tests.support import ROOT

TINY = ROOT / "seeds" / "tiny"
SMOLLM2_RUN = ROOT / "bench" / "results" / "smollm2-135m"
SMOLLM2_PLAN = ROOT / "plans" / "smollm2-135m.toml"
CONVERSATIONS = [
    [{"role": "user", "content": "Table:\nid=J327 city=Oslo units=19\nWhat about J327?"}],
    [
        {"role": "user", "content": "héllo  wörld, 12345 😀\ttabs\n\nand <|im_end|> typed by a user"},
        {"role": "assistant", "content": '{"id": "J327", "found": true}'},
        {"role": "user", "content": "again?"},
        {"role": "assistant", "content": "  spaced  "},
    ],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed SmolLM2-135M run's evidence bundle: its seed folder holds the seed's tokenizer files."""
    folder = tmp_path_factory.mktemp("smollm2")
    with tarfile.open(SMOLLM2_RUN / "evidence.tar.gz") as tar:
        tar.extractall(folder, filter="data")
    return folder


def test_the_tokenizer_identity_of_each_committed_seed_is_the_one_its_plan_records(bundle: Path) -> None:
    assert tokenizer_identity(TINY) == load_plan(ROOT / "plans" / "local.toml").seed.tokenizer_identity
    assert tokenizer_identity(bundle / "seed") == load_plan(SMOLLM2_PLAN).seed.tokenizer_identity


def _same_as_transformers(tokenizer: SeedTokenizer, folder: Path) -> None:
    from experiment.seed import seedmodel

    reference = seedmodel.load_tokenizer(folder)
    assert sorted(tokenizer.all_special_tokens) == sorted(reference.all_special_tokens)
    assert (tokenizer.eos_id, tokenizer.pad_id) == (
        reference.convert_tokens_to_ids(reference.eos_token),
        reference.pad_token_id,
    )
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            text = tokenizer.render(messages, add_generation_prompt=prompt)
            assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            encoded = reference(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = tokenizer.encode_with_offsets(text)
            assert ids == tokenizer.encode(text) == list(encoded["input_ids"])
            assert offsets == [tuple(span) for span in encoded["offset_mapping"]]
            for cut in (ids, ids[1:-1], ids[:3]):  # cuts may split a character's bytes
                assert tokenizer.decode(cut) == reference.decode(cut, skip_special_tokens=False)


@pytest.mark.parametrize("seed", ["tiny", "smollm2"])
def test_the_tokenizer_renders_encodes_and_decodes_as_transformers_does(seed: str, bundle: Path) -> None:
    folder = TINY if seed == "tiny" else bundle / "seed"
    _same_as_transformers(read_tokenizer(folder), folder)


def test_a_tokenizer_transformers_rebuilds_is_read_through_transformers(bundle: Path, tmp_path: Path) -> None:
    """A hub folder's tokenizer_config.json names GPT2Tokenizer, which transformers rebuilds from the vocabulary:
    its backend is transformers', not tokenizer.json as the tokenizers library reads it."""
    folder = tmp_path / "hub"
    shutil.copytree(bundle / "seed", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="GPT2Tokenizer", add_prefix_space=False)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert seedtokenizer._read_directly(folder, config) is None
    _same_as_transformers(read_tokenizer(folder), folder)


def test_prepare_builds_the_committed_smollm2_runs_prepared_files_from_its_tokenizer(bundle: Path) -> None:
    """Every role's bytes (prompt ids, documents, labels, retention probes), made with the tokenizer read without
    transformers, are the committed run's, which transformers' tokenizer made."""
    plan = load_plan(SMOLLM2_PLAN)
    sources = corpus._read_sources(plan, SMOLLM2_PLAN, None)
    roles = corpus._build_roles(plan, read_tokenizer(bundle / "seed"), sources, lambda _: None)
    manifest = msgspec.json.decode((bundle / "prepared" / "manifest.json").read_bytes(), type=Manifest)
    built = {name: sha256_bytes(data) for name, data in roles.contents().items()}
    assert built == {name: role.sha256 for name, role in manifest.roles.items()}
