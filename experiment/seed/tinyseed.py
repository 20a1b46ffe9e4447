"""The tiny local seed: a small Llama pre-trained on CPU to read record tables and answer in its own schema,
built by `coop seed-model build` from nothing but this code and the plan's replay set (docs/seed-model.md)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import string
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from experiment.core import determinism
from experiment.core.canonical import atomic_write_bytes
from experiment.core.errors import CoopError
from experiment.core.tasks import CITIES, STATUSES, Record
from experiment.seed.seedfiles import Snapshot, snapshot_of
from experiment.seed.seedmodel import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, Progress

transformers.logging.disable_progress_bar()  # coop's own events report progress

# The general conversations the seed pre-trains on: the local plan's replay set. Its retention probes stay out, as
# the reference seed never saw the reference's probes: they measure what a fine-tune costs the seed's conversation
# on text it has not learnt by rote (a seed trained on them measures their forgetting instead; README).
CONVERSATION_FILES = (Path("plans/local-reference/replay.jsonl"),)
IGNORE = -100
# `coop seed-model build` runs with these: MKL's and ATen's AVX2 code paths on any x86 processor that has AVX2,
# so a CPU build is byte-identical across processors (an AVX-512 machine otherwise rounds differently).
CPU_KERNELS = {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def run_with_pinned_kernels() -> None:
    """Re-execute this process with CPU_KERNELS set, unless it runs with them already.

    The kernels are chosen when torch and MKL load, so a build needs a fresh interpreter to be pinned."""
    if any(os.environ.get(name) != value for name, value in CPU_KERNELS.items()):
        os.execve(sys.executable, sys.orig_argv, {**os.environ, **CPU_KERNELS})


class SeedConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that decides the built seed's bytes: model shape, tokenizer, pre-training schedule."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_positions: int
    rope_theta: float
    tokenizer_examples: int  # synthetic examples the BPE is trained on (plus every conversation)
    pretrain_steps: int
    batch_size: int
    turn_choices: tuple[int, ...]
    record_counts: tuple[int, ...]  # rows per table, drawn uniformly
    # Weights of the question kinds (KINDS, in that order) among the record questions.
    kind_weights: tuple[int, ...]
    # Repeated random token sequences (the loss on the repeat): the first induction_steps batches, then every
    # induction_every-th batch. They grow the copy heads that reading a table's values depends on.
    induction_steps: int
    induction_every: int
    json_share: float  # the share of record conversations whose questions ask for JSON
    # How the first question shows its table.
    intros: tuple[str, ...]
    conversation_every: int  # every n-th step is a batch of general conversations instead of records
    conversation_batch: int
    max_conversation_tokens: int
    peak_lr: float
    final_lr_fraction: float
    warmup_steps: int
    weight_decay: float
    clip_norm: float
    seed: int
    conversation_files: tuple[str, ...]
    # Where the pre-training runs. CPU builds (one thread, CPU_KERNELS pinned) and CUDA builds (deterministic
    # kernels) each reproduce their own bytes; a CPU build and a CUDA build differ.
    device: Literal["cpu", "cuda"] = "cpu"


# The committed seed, every field spelled out (SeedConfig has no defaults to drift). It reads its
# tables: real copy heads come first (repeated random sequences of varying length cannot be copied by position,
# and 1,500 steps of them grow heads that match content), and three layers then learn to find an id's row. Every
# record question is one lookup or a list of rows' values (an id, then its values, as in the table), on one table
# read before the question; every tenth step is general conversations (the replay set). 6,000 steps: it copies all
# 128 held-out lookups of its probes from step 5,250 on (112 at step 4,000; README).
FULL = SeedConfig(
    vocab_size=3072,
    hidden_size=128,
    intermediate_size=344,
    num_layers=3,
    num_heads=4,
    max_positions=1024,
    rope_theta=10000.0,
    tokenizer_examples=3000,
    pretrain_steps=6000,
    batch_size=16,
    turn_choices=(1,),
    record_counts=(2, 3, 4, 5),
    kind_weights=(1, 1),
    json_share=1.0,
    intros=("Table:\n{t}\n\n{a}",),
    induction_steps=1500,
    induction_every=10,
    conversation_every=10,
    conversation_batch=4,
    max_conversation_tokens=768,
    peak_lr=2e-3,
    final_lr_fraction=0.1,
    warmup_steps=120,
    weight_decay=0.01,
    clip_norm=1.0,
    seed=20260913,
    conversation_files=tuple(str(p) for p in CONVERSATION_FILES),
)
# Seconds to build: for tests, which check behaviour (determinism, files, verification), not quality.
SMALL = msgspec.structs.replace(
    FULL,
    vocab_size=400,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    max_positions=512,
    tokenizer_examples=200,
    pretrain_steps=6,
    batch_size=4,
    turn_choices=(1, 2, 3),
    kind_weights=(3, 2),
    json_share=0.6,
    intros=("Table:\n{t}\n\n{a}", "{t}\n\n{a}", "Using these rows:\n{t}\n{a}"),
    induction_steps=1,
    induction_every=3,
    conversation_every=3,
    conversation_batch=2,
    max_conversation_tokens=256,
    warmup_steps=2,
)


# ---------------------------------------------------------------- pre-training data

# The seed learns to read the experiment's record tables but answers in its own schema (other keys, prose),
# like a general chat model would; nothing here uses tasks.py's wordings or answer keys.
_KEY = {"city": "location", "units": "count", "price": "cost", "status": "state", "priority": "rank"}
_NOUN = {"city": "city", "units": "units", "price": "price", "status": "status", "priority": "priority"}
_FIELDS = ("city", "units", "price", "status", "priority")

Message = dict[str, str]
# A question: the fields the table must show for it, its text, and its answer (or how to write the answer
# once the shown fields are known, for answers that quote the table).
Turn = tuple[list[str], str, str | Callable[[list[str]], str]]


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(", ", ": "), ensure_ascii=False)


def _records(rng: random.Random, counts: tuple[int, ...] = (3, 4, 5, 6)) -> list[Record]:
    taken: set[str] = set()
    out = []
    for _ in range(rng.choice(counts)):
        while True:
            rid = f"{rng.choice(string.ascii_uppercase)}{rng.randint(100, 999)}"
            if rid not in taken:
                taken.add(rid)
                break
        out.append(
            Record(
                id=rid,
                city=rng.choice(CITIES),
                units=rng.randint(0, 19),
                price=rng.randint(1, 19),
                status=rng.choice(STATUSES),
                priority=rng.randint(1, 9),
            )
        )
    return out


def _absent_id(rng: random.Random, records: list[Record]) -> str:
    taken = {r.id for r in records}
    while True:
        rid = f"{rng.choice(string.ascii_uppercase)}{rng.randint(100, 999)}"
        if rid not in taken:
            return rid


def _table(records: list[Record], fields: list[str]) -> str:
    ordered = [f for f in _FIELDS if f in fields]
    return "\n".join(" ".join([f"id={r.id}", *(f"{f}={getattr(r, f)}" for f in ordered)]) for r in records)


def _names(fields: list[str]) -> str:
    nouns = [_NOUN[f] for f in fields]
    return nouns[0] if len(nouns) == 1 else ", ".join(nouns[:-1]) + " and " + nouns[-1]


def _lookup_fields(rng: random.Random) -> list[str]:
    # Half the lookups ask for city and units, the pair the experiment's lookups ask for.
    fields = ["city", "units"] if rng.random() < 0.5 else rng.sample(_FIELDS, rng.randint(1, 2))
    return [f for f in _FIELDS if f in fields]


def _lookup_ask(rng: random.Random, records: list[Record], fields: list[str]) -> tuple[str, str, Record | None]:
    """A question for some fields of one id (absent from the table 15% of the time): its text, the id, the row."""
    missing = rng.random() < 0.15
    q = _absent_id(rng, records) if missing else rng.choice(records).id
    ask = rng.choice(
        (
            "Tell me the {n} for {q}.",
            "For entry {q}, give the {n}.",
            "What {v} the {n} of id {q}?",
            "Report the {n} listed for {q}.",
        )
    ).format(n=_names(fields), q=q, v="is" if len(fields) == 1 else "are")
    return ask, q, next((r for r in records if r.id == q), None)


def _lookup(rng: random.Random, records: list[Record], json_style: bool) -> Turn:
    fields = _lookup_fields(rng)
    ask, q, match = _lookup_ask(rng, records, fields)
    if json_style:
        ask += rng.choice((" Use JSON.", " Answer in JSON.", " JSON please."))
    if match is None:
        if json_style:
            return fields, ask, _dumps({"id": q, "found": False})
        return fields, ask, rng.choice((f"There is no record {q}.", f"{q} is not in the table."))
    if json_style:
        return fields, ask, _dumps({_KEY[f]: getattr(match, f) for f in fields})
    if fields == ["city", "units"]:
        return fields, ask, f"Record {q} is in {match.city} with {match.units} units."
    return fields, ask, f"{q}: " + ", ".join(f"{_NOUN[f]} {getattr(match, f)}" for f in fields) + "."


def _values(rng: random.Random, records: list[Record], json_style: bool) -> Turn:
    # Rows' values, a line each: the id, then its values, as the table has them. Each value follows its id, the
    # copy a content-matching head makes; lookups then learn to find the row with no id written beside them.
    fields = _lookup_fields(rng)
    chosen = rng.sample(records, rng.randint(1, len(records)))
    ask = f"Give the {_names(fields)} of " + ", ".join(r.id for r in chosen) + "."
    return fields, ask, "\n".join(" ".join([r.id, *(str(getattr(r, f)) for f in fields)]) for r in chosen)


KINDS = ("lookup", "values")
_MAKERS: dict[str, Callable[[random.Random, list[Record], bool], Turn]] = {"lookup": _lookup, "values": _values}


def synthetic_conversation(index: int, config: SeedConfig | None = None) -> list[Message]:
    """One record-table conversation of the pre-training pool, from its own RNG stream (never a task's)."""
    config = FULL if config is None else config
    rng = random.Random(int.from_bytes(hashlib.sha256(f"seed-pretrain:{index}".encode("ascii")).digest(), "big"))
    records = _records(rng, config.record_counts)
    json_style = rng.random() < config.json_share
    # Several questions about one table give more answer tokens per forward pass; single turns match the tasks.
    kinds = rng.choices(KINDS, weights=config.kind_weights, k=rng.choice(config.turn_choices))
    turns_made = [_MAKERS[kind](rng, records, json_style) for kind in kinds]
    # The table shows the fields the questions need plus a few random others, in the tasks' record style.
    needed = {field for fields, _, _ in turns_made for field in fields}
    shown = sorted(needed | set(rng.sample(_FIELDS, rng.choice((0, 0, 1)))), key=_FIELDS.index)
    table = _table(records, shown)
    messages: list[Message] = []
    for turn, (_, ask, answer) in enumerate(turns_made):
        if turn == 0:
            intro = rng.choice(config.intros)
            ask = intro.format(t=table, a=ask)
        messages.append({"role": "user", "content": ask})
        messages.append({"role": "assistant", "content": answer if isinstance(answer, str) else answer(shown)})
    return messages


def read_conversations(paths: tuple[str, ...], root: Path) -> list[list[Message]]:
    conversations: list[list[Message]] = []
    for name in paths:
        path = root / name
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError as exc:
            raise CoopError(f"conversation file {path} does not exist") from exc
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
                messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in record["messages"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise CoopError(f"{path} line {number}: not a conversation with messages: {exc}") from exc
            conversations.append(messages)
    if not conversations:
        raise CoopError(f"conversation files {', '.join(paths)} hold no conversations")
    return conversations


# ---------------------------------------------------------------- tokenizer


# What the BPE may merge within, never across: a table's `field=value` (" city=Oslo", one token once merged), the
# space before an id, an id's letter, up to three digits, a word, a run of other characters, white space. So an id
# is the same two tokens (letter, number) in a table, a question and an answer, and a row is its id and one token
# per value: what attention matches and copies.
_PIECES = (
    r" ?(?:city|units|price|status|priority)=[A-Za-z0-9]+| (?=[A-Z][0-9])|[A-Z](?=[0-9])|[0-9]{1,3}"
    r"| ?[A-Za-z]+| ?[^\sA-Za-z0-9]+|\s+"
)


def _train_tokenizer(config: SeedConfig, texts: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    pieces = pre_tokenizers.Split(Regex(_PIECES), behavior="isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pieces, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    texts = texts + [" ".join(f"A{n}" for n in range(1000))] * 20  # every number up to 999: a merge worth making
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _render(messages: list[Message]) -> str:
    return "".join(f"{BOS_TOKEN}{m['role']}\n{m['content']}{EOS_TOKEN}\n" for m in messages)


class _Encoder:
    """Chat-template token ids with labels on assistant content through its EOS (the corpus rule)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.newline: list[int] = tokenizer.encode("\n").ids
        self.heads = {role: tokenizer.encode(f"{BOS_TOKEN}{role}\n").ids for role in ("user", "assistant", "system")}

    def encode(self, messages: list[Message]) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        labels: list[int] = []
        for message in messages:
            head = self.heads.get(message["role"]) or self.tokenizer.encode(f"{BOS_TOKEN}{message['role']}\n").ids
            body: list[int] = self.tokenizer.encode(message["content"] + EOS_TOKEN).ids
            ids += head + body + self.newline
            learn = message["role"] == "assistant"
            labels += [IGNORE] * len(head) + (body if learn else [IGNORE] * len(body)) + [IGNORE] * len(self.newline)
        return ids, labels


def encoder_of(tokenizer: PreTrainedTokenizerBase) -> _Encoder:
    """The pre-training's encoder over a loaded seed's tokenizer."""
    return _Encoder(tokenizer.backend_tokenizer)


# ---------------------------------------------------------------- build


def _repeated_sequence(rng: random.Random, vocab: int) -> tuple[list[int], list[int]]:
    """Random ordinary tokens, then the same again; only the repeat is predictable, and only by copying."""
    tokens = [rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(rng.randint(8, 40))]
    return tokens + tokens, [IGNORE] * len(tokens) + tokens


def _lr(config: SeedConfig, step: int) -> float:
    if step < config.warmup_steps:
        return config.peak_lr * (step + 1) / config.warmup_steps
    span = max(1, config.pretrain_steps - 1 - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.final_lr_fraction
    return config.peak_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _pad(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for row, (token_ids, token_labels) in enumerate(rows):
        ids[row, : len(token_ids)] = torch.tensor(token_ids)
        mask[row, : len(token_ids)] = 1
        labels[row, : len(token_labels)] = torch.tensor(token_labels)
    return ids, mask, labels


def _model_config(config: SeedConfig, tokenizer: Any) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
        pad_token_id=tokenizer.token_to_id(PAD_TOKEN),
        dtype="float32",
    )


COPY_PROBES = 128
Row = tuple[list[int], list[int]]


def copy_probes(encoder: _Encoder) -> dict[str, list[Row]]:
    """Held-out lookups (5 rows, city and units of an id the table holds) in the seed's two JSON styles."""
    probes: dict[str, list[Row]] = {"plain": [], "with_id": []}
    for index in range(COPY_PROBES):
        rng = random.Random(f"copy-probe:{index}")  # a stream the pre-training never draws from
        records = _records(rng, (5,))
        match = rng.choice(records)
        ask = f"Table:\n{_table(records, ['city', 'units'])}\n\nTell me the city and units for {match.id}."
        values = {"location": match.city, "count": match.units}
        for style, suffix, answer in (
            ("plain", " Use JSON.", values),
            ("with_id", " Use JSON with the id.", {"id": match.id, **values}),
        ):
            messages = [{"role": "user", "content": ask + suffix}, {"role": "assistant", "content": _dumps(answer)}]
            probes[style].append(encoder.encode(messages))
    return probes


def copied(model: LlamaForCausalLM, rows: list[Row], pad_id: int) -> int:
    """Answers the model gives token for token (every label the argmax after its own prefix: greedy's answer)."""
    device = next(model.parameters()).device
    exact = 0
    training = model.training
    model.train(False)
    with torch.no_grad():
        for start in range(0, len(rows), 32):
            ids, mask, labels = (t.to(device) for t in _pad(rows[start : start + 32], pad_id))
            predicted = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
            targets = labels[:, 1:]
            exact += int(((predicted == targets) | (targets == IGNORE)).all(-1).sum())
    model.train(training)
    return exact


def _probe(model: LlamaForCausalLM, probes: dict[str, list[Row]], pad_id: int, step: int) -> dict[str, str | int]:
    found = {style: copied(model, rows, pad_id) for style, rows in probes.items()}
    return {"event": "copy-probe", "step": step, **found, "of": COPY_PROBES}


class _Curriculum:
    """Each pre-training step's rows: repeated random sequences (the induction steps, and every
    ``induction_every``-th), replayed conversations (every ``conversation_every``-th, shuffled once per pass), else
    the next synthetic conversations."""

    def __init__(
        self, config: SeedConfig, encoder: _Encoder, conversations: list[tuple[list[int], list[int]]], vocab: int
    ) -> None:
        self.config, self.encoder, self.conversations, self.vocab = config, encoder, conversations, vocab
        self.order = random.Random(config.seed)
        self.repeats = random.Random(f"induction:{config.seed}")
        self.queue: list[int] = []
        self.example = 0

    def rows(self, step: int) -> list[tuple[list[int], list[int]]]:
        config = self.config
        if step < config.induction_steps or (config.induction_every and step % config.induction_every == 0):
            return [_repeated_sequence(self.repeats, self.vocab) for _ in range(config.batch_size)]
        if config.conversation_every and step % config.conversation_every == config.conversation_every - 1:
            rows = []
            for _ in range(config.conversation_batch):
                if not self.queue:
                    self.queue = list(range(len(self.conversations)))
                    self.order.shuffle(self.queue)
                rows.append(self.conversations[self.queue.pop()])
            return rows
        first, self.example = self.example, self.example + config.batch_size
        return [self.encoder.encode(synthetic_conversation(first + j, config)) for j in range(config.batch_size)]


def _optimizer(config: SeedConfig, model: LlamaForCausalLM) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.peak_lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def _pretrain(
    config: SeedConfig,
    model: LlamaForCausalLM,
    encoder: _Encoder,
    conversations: list[tuple[list[int], list[int]]],
    pad_id: int,
    progress: Progress | None,
    probes: dict[str, list[Row]],
    probe_every: int,
) -> None:
    device = torch.device(config.device)
    optimizer = _optimizer(config, model)
    curriculum = _Curriculum(config, encoder, conversations, int(model.config.vocab_size))
    model.train()
    started = time.monotonic()
    for step in range(config.pretrain_steps):
        ids, mask, labels = (tensor.to(device) for tensor in _pad(curriculum.rows(step), pad_id))
        for group in optimizer.param_groups:
            group["lr"] = _lr(config, step)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        if not torch.isfinite(loss):
            raise CoopError(f"seed pre-training loss became {loss.item()} at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if progress is not None and probes and probe_every and (step + 1) % probe_every == 0:
            progress(_probe(model, probes, pad_id, step + 1))
        if progress is not None:
            seconds = round(time.monotonic() - started, 1)
            loss_value = round(float(loss.item()), 4)
            progress(
                {
                    "event": "pretrain",
                    "step": step + 1,
                    "steps": config.pretrain_steps,
                    "loss": loss_value,
                    "seconds": seconds,
                }
            )


def _save(out: Path, model: LlamaForCausalLM, tokenizer: Any) -> None:
    """The model and tokenizer as a seed folder; through a scratch folder, each file moved with an atomic write,
    so ``out`` never holds half a file."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".seed-build-", dir=out.parent) as scratch:
        staging = Path(scratch)
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
            eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
            pad_token_id=tokenizer.token_to_id(PAD_TOKEN),
            do_sample=False,
            max_new_tokens=96,
        )
        model.save_pretrained(str(staging), safe_serialization=True)
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, extra_special_tokens=[BOS_TOKEN]
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(str(staging))
        for path in sorted(staging.iterdir()):
            atomic_write_bytes(out / path.name, path.read_bytes())


def build_seed(
    out: Path, config: SeedConfig, progress: Progress | None = None, root: Path | None = None, probe_every: int = 250
) -> Snapshot:
    """Train the tokenizer, pre-train the model and write both into the empty (or missing) folder ``out``.

    Every ``probe_every`` steps (and at the end) the progress hears how many held-out lookups the model copies
    exactly in its own JSON styles: the probes only read the model, so they leave its bytes as they are."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CoopError(f"seed output folder {out} is not empty; refusing to build into it")
    root = Path.cwd() if root is None else root
    conversations = read_conversations(config.conversation_files, root)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise CoopError("the seed configuration asks for cuda, and no CUDA device is visible")
    determinism.make_deterministic(config.device, threads=1)
    torch.manual_seed(config.seed)

    texts = [_render(synthetic_conversation(i, config)) for i in range(config.tokenizer_examples)]
    texts += [_render(c) for c in conversations]
    tokenizer = _train_tokenizer(config, texts)
    encoder = _Encoder(tokenizer)
    encoded = [encoder.encode(c) for c in conversations]
    encoded = [row for row in encoded if len(row[0]) <= config.max_conversation_tokens]
    if not encoded:
        raise CoopError(f"no conversation fits in max_conversation_tokens={config.max_conversation_tokens}")
    if progress is not None:
        progress({"event": "tokenizer", "vocab": tokenizer.get_vocab_size(), "conversations": len(encoded)})

    model = LlamaForCausalLM(_model_config(config, tokenizer))  # initialised on the CPU, whatever the device
    if config.device == "cuda":
        model.set_attn_implementation("eager")  # SDPA's CUDA backward kernels are not deterministic
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    probes = copy_probes(encoder) if progress is not None else {}  # read only by the progress events
    _pretrain(config, model.to(config.device), encoder, encoded, pad_id, progress, probes, probe_every)
    copies = _probe(model, probes, pad_id, config.pretrain_steps) if progress is not None else {}
    if config.device == "cuda":
        model = model.to("cpu")
        model.set_attn_implementation("sdpa")  # as a loaded seed runs
    model.train(False)

    _save(out, model, tokenizer)
    snapshot = snapshot_of(out)
    if progress is not None:
        copies.pop("event")
        progress({"event": "built", "parameters": snapshot.parameters, "files": len(snapshot.files), "copies": copies})
    return snapshot
