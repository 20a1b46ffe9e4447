"""The batched greedy decoder (experiment.learning.decoding) on the real SmolLM2-135M-Instruct seed: the ids
transformers' own greedy generate gives one prompt at a time, with transformers' model of the same folder. The tiny
seed's longer decodings, with rows leaving their batch, are in test_evaluation_report.py; the model's logits and
gradients against transformers' are in tests/unit/test_llama.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiment.core import tasks
from experiment.learning import corpus, decoding
from experiment.seed import seedmodel, seedtokenizer
from tests.support.greedy import hf_greedy, hf_model

pytestmark = pytest.mark.slow


@pytest.mark.usefixtures("one_thread")
def test_batched_generation_equals_hf_generate_one_prompt_at_a_time(smollm2: Path) -> None:
    tokenizer = seedtokenizer.read_tokenizer(smollm2)
    model = seedmodel.load_model(smollm2).eval()
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    prompts = [
        corpus.prompt_ids(tokenizer, tasks.render_prompt(tasks.make_case(2026091301, "dev", i))) for i in range(6)
    ]
    assert len({len(p) for p in prompts}) > 1  # the batches are padded
    batched = decoding.generate(model, prompts, eos, pad, 48, batch_size=4)  # two batches: 4 and 2 prompts
    truth = hf_model(smollm2)
    assert [g.output_ids for g in batched] == [hf_greedy(truth, p, eos, pad, 48) for p in prompts]
