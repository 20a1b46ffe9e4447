"""The seed's architecture, Llama as SmolLM2 has it, in torch alone.

The parameters carry the names a Hugging Face folder stores them by (``model.layers.0.self_attn.q_proj.weight``, a tied
``lm_head.weight`` stored once as ``model.embed_tokens.weight``), so a checkpoint is a folder vLLM and transformers
read. The forward is transformers' LlamaForCausalLM (its RMS norm, rotary embedding, SDPA attention with its choice
of mask and grouped-query path, gated MLP), op for op: logits, gradients and greedy answers are transformers' to the
bit (tests/unit/test_llama.py holds them to it, with transformers as the reference). Loading it takes a fraction of
the seconds that importing transformers takes, which every training and evaluation process used to pay."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import safetensors
import safetensors.torch
import torch
from torch import nn

from experiment.core.errors import CoopError
from experiment.seed.shape import Shape

WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class Config(Shape):
    """The fields of a Llama config.json that the forward reads: its shape, and the norm, rotary and padding
    settings."""

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    pad_token_id: int | None = None

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Config:
        """The config of a config.json's fields; refused when it asks for what this forward does not compute."""
        problems = _unsupported(raw)
        if problems:
            raise CoopError(f"not a Llama this forward computes: {'; '.join(problems)}")
        rope = raw.get("rope_parameters") or {}
        return cls(
            **Shape.fields(raw),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            pad_token_id=None if raw.get("pad_token_id") is None else int(raw["pad_token_id"]),
        )


def _unsupported(raw: Mapping[str, Any]) -> list[str]:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    heads = int(raw["num_attention_heads"])
    checks = {
        "model_type": (raw.get("model_type"), "llama"),
        "head_dim": (int(raw.get("head_dim") or int(raw["hidden_size"]) // heads), int(raw["hidden_size"]) // heads),
        "hidden_act": (raw.get("hidden_act", "silu"), "silu"),
        "attention_bias": (bool(raw.get("attention_bias", False)), False),
        "mlp_bias": (bool(raw.get("mlp_bias", False)), False),
        "attention_dropout": (float(raw.get("attention_dropout", 0.0)), 0.0),
        "rope type": (rope.get("rope_type", rope.get("type", "default")), "default"),
    }
    return [f"{name} is {found!r}, not {wanted!r}" for name, (found, wanted) in checks.items() if found != wanted]


class KVCache(Protocol):
    """Where a decoder layer keeps the keys and values of the positions read so far."""

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values every position read so far, ``keys`` and ``values`` included, in order."""
        ...


class Llama(nn.Module):
    """LlamaForCausalLM's modules under its names: ``model`` (embeddings, decoder layers, final norm, rotary
    embedding) and ``lm_head``, tied to the embeddings when the config says so. The parameters are allocated on
    ``device`` and left uninitialised: ``load`` fills them from a folder. (No initialiser runs: on the meta device
    the first one would import torch's compiler, a second of CPU a process.)"""

    def __init__(self, config: Config, device: torch.device | str = "meta") -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config, torch.device(device))
        self.lm_head = _Linear(config.hidden_size, config.vocab_size, torch.device(device))
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> torch.Tensor:
        """The logits of the positions ``logits_to_keep`` names: the last so many (0 keeps all), or those a 1-D
        tensor lists. ``attention_mask`` is 1 over each row's tokens, 0 over its padding, across every position the
        cache holds after this read; ``position_ids`` default to 0, 1, ... when nothing was read before."""
        hidden = self.model(input_ids, position_ids, attention_mask, cache)
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits: torch.Tensor = self.lm_head(hidden[:, kept, :])
        return logits


def load(model_dir: Path) -> Llama:
    """The model of a seed or checkpoint folder in float32, on the CPU, its tied weight one tensor."""
    config = Config.read(model_dir)
    try:
        tensors = safetensors.torch.load_file(str(model_dir / WEIGHTS))
    except (OSError, safetensors.SafetensorError) as exc:
        raise CoopError(f"cannot load the model from {model_dir}: {exc}") from exc
    if config.tie_word_embeddings and "model.embed_tokens.weight" not in tensors and "lm_head.weight" in tensors:
        tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")  # the tied pair under its other name
    model = Llama(config)
    expected = {name for name, _ in model.named_parameters()}  # a tied weight under its first name
    problems = [f"missing {name}" for name in sorted(expected - tensors.keys())]
    problems += [f"extra {name}" for name in sorted(tensors.keys() - expected)]
    if problems:
        raise CoopError(f"the weights of {model_dir} do not fit its config.json: {'; '.join(problems)}")
    model.load_state_dict(
        {name: tensor.to(torch.float32) for name, tensor in tensors.items()}, strict=False, assign=True
    )
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.reset()
    return model


class _Linear(nn.Module):
    """nn.Linear without a bias or an initialiser: the same ``F.linear``."""

    def __init__(self, inputs: int, outputs: int, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, inputs, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class _Embedding(nn.Module):
    """nn.Embedding without an initialiser: the same ``F.embedding``, the padding id's row getting no gradient."""

    def __init__(self, vocabulary: int, size: int, padding_idx: int | None, device: torch.device) -> None:
        super().__init__()
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.empty(vocabulary, size, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight, self.padding_idx)


class _Body(nn.Module):
    def __init__(self, config: Config, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, config.pad_token_id, device)
        layers = [_DecoderLayer(config, index, device) for index in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.rotary_emb = _Rotary(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        cache: KVCache | None,
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos, sin = self.rotary_emb(hidden, position_ids)
        read = _Read(cos.unsqueeze(1), sin.unsqueeze(1), _causal_mask(attention_mask, hidden.shape[1]), cache)
        for layer in self.layers:
            hidden = layer(hidden, read)
        normed: torch.Tensor = self.norm(hidden)
        return normed


def _causal_mask(attention_mask: torch.Tensor | None, reading: int) -> torch.Tensor | None:
    """transformers' SDPA mask: None (SDPA's own causal rule) when no position is padding and the read is one
    position or everything; else True where a query position may attend to a key position, (rows, 1, read, keys)."""
    if attention_mask is None:
        return None
    padding = attention_mask.bool()
    keys = padding.shape[-1]
    if (reading == 1 or keys == reading) and bool(padding.all()):
        return None
    queries = torch.arange(reading, device=padding.device) + (keys - reading)
    causal = torch.arange(keys, device=padding.device)[None, :] <= queries[:, None]
    return causal[None, None, :, :] & padding[:, None, None, :]


@dataclass(frozen=True)
class _Read:
    """What every decoder layer reads beside its hidden states: the rotary embedding's cosines and sines (one head
    axis), the attention mask (None: SDPA's causal rule) and the cache."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    cache: KVCache | None


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=device))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        normed: torch.Tensor = self.weight * hidden.to(dtype)
        return normed


class _Rotary(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.theta, self.dim = config.rope_theta, config.head_dim
        self.reset()

    def reset(self) -> None:
        """The inverse frequencies, computed anew (a model built on the meta device has none)."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float, device="cpu") / self.dim
        self.register_buffer("inv_freq", 1.0 / (self.theta**exponents), persistent=False)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=hidden.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype=hidden.dtype), angles.sin().to(dtype=hidden.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, config: Config, layer: int, device: torch.device) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, config.head_dim
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        width, kv_width = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = _Linear(config.hidden_size, width, device)
        self.k_proj = _Linear(config.hidden_size, kv_width, device)
        self.v_proj = _Linear(config.hidden_size, kv_width, device)
        self.o_proj = _Linear(width, config.hidden_size, device)

    def forward(self, hidden: torch.Tensor, read: _Read) -> torch.Tensor:
        shape = hidden.shape[:-1]
        heads = (*shape, -1, self.head_dim)
        query = self.q_proj(hidden).view(heads).transpose(1, 2)
        key = self.k_proj(hidden).view(heads).transpose(1, 2)
        value = self.v_proj(hidden).view(heads).transpose(1, 2)
        query = (query * read.cos) + (_rotate_half(query) * read.sin)
        key = (key * read.cos) + (_rotate_half(key) * read.sin)
        if read.cache is not None:
            key, value = read.cache.update(self.layer, key, value)
        attended = self._sdpa(query, key, value, read.mask)
        return self.o_proj(attended.reshape(*shape, -1).contiguous())  # type: ignore[no-any-return]

    def _sdpa(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """transformers' SDPA call: grouped-query attention inside SDPA without a mask; one query position packed
        onto the key heads with one; the key heads repeated otherwise."""
        reading, gqa = query.shape[2], False
        if self.groups > 1:
            if mask is None and key.shape[-1] == value.shape[-1] <= 256:
                gqa = True
            elif reading == 1:
                batch, heads, _, dim = query.shape
                query = query.reshape(batch, heads // self.groups, self.groups, dim)
            else:
                key, value = _repeat(key, self.groups), _repeat(value, self.groups)
        attended = nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=0.0,
            scale=self.scaling,
            is_causal=reading > 1 and mask is None,
            enable_gqa=gqa,
        )
        attended = attended.reshape(attended.shape[0], -1, reading, value.shape[-1])
        return attended.transpose(1, 2).contiguous()


def _repeat(states: torch.Tensor, groups: int) -> torch.Tensor:
    batch, heads, length, dim = states.shape
    expanded = states[:, :, None, :, :].expand(batch, heads, groups, length, dim)
    return expanded.reshape(batch, heads * groups, length, dim)


class _MLP(nn.Module):
    def __init__(self, config: Config, device: torch.device) -> None:
        super().__init__()
        self.gate_proj = _Linear(config.hidden_size, config.intermediate_size, device)
        self.up_proj = _Linear(config.hidden_size, config.intermediate_size, device)
        self.down_proj = _Linear(config.intermediate_size, config.hidden_size, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class _DecoderLayer(nn.Module):
    def __init__(self, config: Config, layer: int, device: torch.device) -> None:
        super().__init__()
        self.self_attn = _Attention(config, layer, device)
        self.mlp = _MLP(config, device)
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps, device)

    def forward(self, hidden: torch.Tensor, read: _Read) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), read)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))  # type: ignore[no-any-return]
