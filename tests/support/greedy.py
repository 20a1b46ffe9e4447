"""The independent truth for the seed's model: transformers' own LlamaForCausalLM of the same folder, and its
generate on one unpadded prompt at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_model(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model of a seed or checkpoint folder, in ``dtype``, for inference."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32).to(dtype).eval()


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], eos: int, pad: int, max_new_tokens: int) -> list[int]:
    """The greedy output ids of ``prompt`` through the first EOS, by transformers' ``model.generate`` with no
    padding."""
    output = model.generate(
        input_ids=torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    row = [int(t) for t in output[0, len(prompt) :].tolist()]
    return row[: row.index(eos) + 1] if eos in row else row
