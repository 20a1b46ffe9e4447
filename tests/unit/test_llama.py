"""The seed's own Llama (experiment.seed.llama) against transformers' LlamaForCausalLM of the same folder, the
independent truth: the same parameters under the same names, and logits, gradients and greedy answers equal to the
bit, in float32 and under bfloat16 autocast, with grouped-query attention and without, on padded batches read
through the decoder's cache. SmolLM2-135M's own figures are in tests/integration/test_decoding.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from experiment.core.errors import CoopError
from experiment.learning import decoding
from experiment.seed import llama
from tests.support.greedy import hf_greedy, hf_model


def _folder(tmp_path: Path, key_value_heads: int) -> Path:
    """A random Llama of SmolLM2's kind (tied embeddings, RMS norm eps of 1e-5, rope theta 1e5), saved by
    transformers."""
    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=key_value_heads, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, pad_token_id=2, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    folder = tmp_path / f"kv{key_value_heads}"
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(params=[6, 2], ids=["heads", "grouped"])
def folder(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return _folder(tmp_path, request.param)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_logits_and_gradients_are_transformers_to_the_bit(folder: Path, autocast: bool) -> None:
    ours, truth = llama.load(folder), hf_model(folder).train()
    assert ours.state_dict().keys() == truth.state_dict().keys()
    assert [name for name, _ in ours.named_parameters()] == [name for name, _ in truth.named_parameters()]
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids, kept = torch.randint(3, 96, (1, 40)), torch.tensor([4, 17, 39])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = ours(ids, logits_to_keep=kept)
        expected = truth(input_ids=ids, logits_to_keep=kept).logits
    assert torch.equal(logits, expected)
    logits.float().square().sum().backward()
    expected.float().square().sum().backward()
    theirs = dict(truth.named_parameters())
    for name, parameter in ours.named_parameters():
        assert parameter.grad is not None and torch.equal(parameter.grad, theirs[name].grad), name


def test_a_padded_batch_reads_as_transformers_reads_it(folder: Path) -> None:
    """Left padding, masked: the mask transformers builds for SDPA, and its grouped-query path with one."""
    ours, truth = llama.load(folder).eval(), hf_model(folder)
    rows = [[5, 9, 11, 40, 41, 7], [2, 2, 2, 13, 14, 15]]
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = ours(torch.tensor(rows), positions, mask)
        expected = truth(input_ids=torch.tensor(rows), attention_mask=mask, position_ids=positions).logits
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_greedy_answers_are_transformers_generate(folder: Path, dtype: torch.dtype) -> None:
    """Prompts of mixed lengths through the decoder's cache (one query position a step, rows leaving as they end),
    against transformers' generate of one unpadded prompt at a time."""
    ours = llama.load(folder).to(dtype).eval()
    truth = hf_model(folder, dtype)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (length,), generator=generator).tolist() for length in (3, 9, 5, 12, 7, 4)]
    answers = decoding.generate(ours, prompts, eos_id=2, pad_id=2, max_new_tokens=24, batch_size=4)
    assert [a.output_ids for a in answers] == [hf_greedy(truth, p, 2, 2, 24) for p in prompts]


def test_a_config_this_forward_does_not_compute_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path, 2)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    config["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CoopError, match="hidden_act is 'gelu', not 'silu'; rope type is 'llama3'"):
        llama.load(folder)


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path, 2)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CoopError, match=r"do not fit its config.json: missing model\.layers\.2\.input_layernorm"):
        llama.load(folder)


def test_a_tied_weight_stored_under_the_heads_name_loads_as_transformers_loads_it(tmp_path: Path) -> None:
    """transformers ties the pair whichever name stores it; vLLM does not (serving/test_probe.py), which is why the
    checkpoints store it under the embedding's name, as the seed does."""
    from safetensors.torch import load_file, save_file

    folder = _folder(tmp_path, 2)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ours, truth = llama.load(folder), hf_model(folder)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(3, 96, (1, 12))
    with torch.no_grad():
        assert torch.equal(ours(ids), truth(input_ids=ids).logits)
