"""Seed models: the model (experiment.seed.llama, torch without transformers), transformers' tokenizer for the few
callers that want it, and the tiny seed's tokens.

A seed folder's snapshot, verification and tensor layout are read without torch (experiment.seed.seedfiles), and so
is its tokenizer (experiment.seed.seedtokenizer); their names are here too, for the callers that load models."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from experiment.core.progress import Emit
from experiment.seed import llama
from experiment.seed.seedfiles import Snapshot as Snapshot
from experiment.seed.seedfiles import TensorLayout as TensorLayout
from experiment.seed.seedfiles import count_parameters as count_parameters
from experiment.seed.seedfiles import layout_differences as layout_differences
from experiment.seed.seedfiles import read_snapshot as read_snapshot
from experiment.seed.seedfiles import safetensors_layout as safetensors_layout
from experiment.seed.seedfiles import snapshot_of as snapshot_of
from experiment.seed.seedfiles import tensor_layout as tensor_layout
from experiment.seed.seedfiles import verify_seed as verify_seed
from experiment.seed.seedtokenizer import load_transformers_tokenizer
from experiment.seed.seedtokenizer import tokenizer_identity as tokenizer_identity

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

Progress = Emit  # the build's events (experiment.core.progress)


def load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of a seed folder (the experiment's commands read it as seedtokenizer.read_tokenizer)."""
    tokenizer: PreTrainedTokenizerBase = load_transformers_tokenizer(directory)
    return tokenizer


def load_model(directory: Path) -> llama.Llama:
    """The model of a seed or checkpoint folder, in float32 on the CPU."""
    return llama.load(directory)
