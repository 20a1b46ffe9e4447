"""Batched greedy decoding with a reserved KV cache: every prompt's output ids are those transformers' greedy generate
gives that prompt alone, one prompt at a time, and on a CPU several times as fast (bench/evaluate.py).

The cache writes in place into buffers reserved for the whole generation, where transformers' DynamicLayer copies
the whole cache to grow it every step. tests/integration/test_decoding.py holds the ids to transformers' generate."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from experiment.learning.answers import Generation as Generation
from experiment.seed.llama import Llama

PREFILL_ROWS = 16  # the prompts one prefill forward reads: on a CPU, more spill its caches (bench/evaluate.py)


@torch.inference_mode()
def generate(
    model: Llama,
    prompts: Sequence[list[int]],
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    batch_size: int,
) -> list[Generation]:
    """Greedy decoding of ``prompts`` in batches of at most ``batch_size`` prompts of similar length (sorted by
    length, then cut); the generations come back in the order of ``prompts``. On a CPU each one's ids are those
    transformers' generate gives its prompt alone (tests/integration/test_decoding.py,
    tests/integration/test_evaluation_report.py). The model answers in its own dtype: ``evaluation.answering_model``
    puts it in the plan's numerics."""
    order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
    generations: dict[int, Generation] = {}
    for start in range(0, len(order), batch_size):
        group = order[start : start + batch_size]
        decoded = _decode(model, [prompts[index] for index in group], eos_id, pad_id, max_new_tokens)
        generations.update(zip(group, decoded, strict=True))
    return [generations[index] for index in range(len(prompts))]


def _decode(
    model: Llama, prompts: Sequence[list[int]], eos_id: int, pad_id: int, max_new_tokens: int
) -> list[Generation]:
    """Greedy decoding of one batch, one token a step on the kept cache; a row that emits EOS leaves the batch,
    and the rest stop together at ``max_new_tokens``."""
    batch = _Batch(model, prompts, pad_id, max_new_tokens)
    tokens = batch.prefill()
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(1, max_new_tokens + 1):
        for row, token in zip(batch.rows.tolist(), tokens.tolist(), strict=True):
            outputs[row].append(token)
        ended = tokens == eos_id
        if step == max_new_tokens or bool(ended.all()):
            break
        if bool(ended.any()):
            tokens = tokens[batch.leave(ended)]
        tokens = batch.step(tokens)
    return [_generation(output, eos_id, max_new_tokens) for output in outputs]


def _generation(output_ids: list[int], eos_id: int, max_new_tokens: int) -> Generation:
    ended = output_ids[-1] == eos_id
    return Generation(
        output_ids=output_ids, ended_with_eos=ended, hit_token_limit=not ended and len(output_ids) >= max_new_tokens
    )


def _left_padded(prompts: Sequence[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded to the longest, and their attention mask."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    return input_ids, _mask(prompts, width, device)


def _mask(prompts: Sequence[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """1 over each prompt's tokens, 0 over the padding that right-aligns it to ``width``."""
    return torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)


class _Batch:
    """The rows still decoding: the cache of everything they read (they are its first rows), each row's index
    among the batch's prompts, its attention mask over the cache and the position of its last token."""

    def __init__(self, model: Llama, prompts: Sequence[list[int]], pad_id: int, max_new_tokens: int):
        self.model, self.prompts, self.pad_id = model, prompts, pad_id
        self.device = next(model.parameters()).device
        self.width = max(len(p) for p in prompts)
        capacity = self.width + max_new_tokens
        self.layers = [_ReservedLayer(len(prompts), capacity) for _ in range(model.config.num_hidden_layers)]
        self.cache = _ReservedCache(self.layers)
        self.rows = torch.arange(len(prompts), device=self.device)
        self.mask = _mask(prompts, self.width, self.device)
        self.positions = torch.tensor([[len(p) - 1] for p in prompts], device=self.device)

    def prefill(self) -> torch.Tensor:
        """Every row's first token. The prompts are read PREFILL_ROWS at a time, each group padded only to its own
        longest prompt, and cached right-aligned to the batch's longest."""
        tokens = []
        for first in range(0, len(self.prompts), PREFILL_ROWS):
            input_ids, mask = _left_padded(self.prompts[first : first + PREFILL_ROWS], self.pad_id, self.device)
            for layer in self.layers:
                layer.fill(first, self.width - input_ids.shape[1])
            # A row counts its own tokens from position 0; its padding sits at position 0, masked out.
            tokens.append(self._greedy(input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)))
        for layer in self.layers:
            layer.filled(self.width)
        return torch.cat(tokens)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each row's next token, after the model reads ``tokens``, one a row."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=-1)
        self.positions = self.positions + 1
        return self._greedy(tokens.unsqueeze(-1), self.mask, self.positions)

    def leave(self, ended: torch.Tensor) -> torch.Tensor:
        """The ``ended`` rows leave, and the rows that go on are again the cache's first rows: those already among
        the first keep their places, the others move into the places the ended rows left. Returns, for each row
        now, the row it was."""
        going_on = torch.nonzero(~ended).squeeze(-1)
        kept = torch.arange(len(going_on), device=self.device)
        kept[torch.nonzero(ended[: len(going_on)]).squeeze(-1)] = going_on[going_on >= len(going_on)]
        for layer in self.layers:
            layer.batch_select_indices(kept)
        self.rows, self.mask, self.positions = self.rows[kept], self.mask[kept], self.positions[kept]
        return kept

    def _greedy(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.model(
            input_ids=input_ids, position_ids=positions, attention_mask=mask, cache=self.cache, logits_to_keep=1
        )
        tokens: torch.Tensor = logits[:, -1, :].argmax(dim=-1)
        return tokens


class _ReservedCache:
    """The model's KV cache (llama.KVCache): one reserved layer a decoder layer."""

    def __init__(self, layers: list[_ReservedLayer]) -> None:
        self.layers = layers

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer].update(keys, values)


class _ReservedLayer:
    """One decoder layer's keys and values for a batch, in buffers reserved for the whole generation: an update
    writes its positions in place, where a DynamicLayer copies the whole cache to grow it. Rows still decoding
    are the first ``rows``; the model sees their first ``length`` positions."""

    def __init__(self, rows: int, capacity: int) -> None:
        self.rows, self.capacity, self.length = rows, capacity, 0
        self.target: tuple[int, int] | None = None
        self.reserved = False

    def fill(self, first_row: int, column: int) -> None:
        """The next update is a prefill of the rows from ``first_row``, written from ``column`` on."""
        self.target = (first_row, column)

    def filled(self, length: int) -> None:
        """The prefill is done: every row holds ``length`` positions, and updates append."""
        self.target, self.length = None, length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.reserved:
            _, heads, _, dim = key_states.shape
            self.key_buffer = key_states.new_empty(self.rows, heads, self.capacity, dim)
            self.value_buffer = value_states.new_empty(self.rows, heads, self.capacity, value_states.shape[-1])
            self.reserved = True
        if self.target is not None:
            first, column = self.target
            rows, end = slice(first, first + key_states.shape[0]), column + key_states.shape[-2]
            for buffer, states in ((self.key_buffer, key_states), (self.value_buffer, value_states)):
                buffer[rows, :, :column] = 0  # never attended (masked), but must be finite
                buffer[rows, :, column:end] = states
            return key_states, value_states  # a prefill group attends to its own prompts only
        end = self.length + key_states.shape[-2]
        self.key_buffer[: self.rows, :, self.length : end] = key_states
        self.value_buffer[: self.rows, :, self.length : end] = value_states
        self.length = end
        return self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Row i becomes what row ``indices[i]`` was. Only the rows that move are copied, in place: a row may move
        only into a place that no kept row comes from (as _Batch.leave moves them)."""
        moved = torch.nonzero(indices != torch.arange(len(indices), device=indices.device)).squeeze(-1)
        sources = indices[moved]
        for buffer in (self.key_buffer, self.value_buffer):
            buffer[moved, :, : self.length] = buffer[sources, :, : self.length]
        self.rows = len(indices)

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_buffer[: self.rows, :, : self.length], self.value_buffer[: self.rows, :, : self.length]
