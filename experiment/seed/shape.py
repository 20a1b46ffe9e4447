"""The size of a Llama, from its config.json: the fields that the memory model counts and that the forward
(experiment.seed.llama) builds its layers from. Pure Python: the doctor and the pages read it without torch."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from experiment.core.errors import CoopError


@dataclass(frozen=True)
class Shape:
    """The fields of a Llama config.json that decide its parameters (and so its memory)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool = True

    @staticmethod
    def fields(raw: Mapping[str, Any]) -> dict[str, Any]:
        """The shape's fields of a config.json's (grouped-query heads and a tied head as transformers defaults them)."""
        heads = int(raw["num_attention_heads"])
        return {
            "vocab_size": int(raw["vocab_size"]),
            "hidden_size": int(raw["hidden_size"]),
            "intermediate_size": int(raw["intermediate_size"]),
            "num_hidden_layers": int(raw["num_hidden_layers"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(raw.get("num_key_value_heads") or heads),
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        }

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Self:
        return cls(**cls.fields(raw))

    @classmethod
    def read(cls, model_dir: Path) -> Self:
        """The shape of the model folder ``model_dir`` (its config.json)."""
        try:
            raw = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise CoopError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
        return cls.of(raw)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def parameters(self) -> int:
        """The parameter count: embeddings (a tied head counted once), attention, gated MLP and RMS norms."""
        hidden, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attention = 2 * hidden * hidden + 2 * hidden * kv  # q and o; k and v
        layer = attention + 3 * hidden * self.intermediate_size + 2 * hidden  # gate, up and down; two norms
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * layer + hidden
