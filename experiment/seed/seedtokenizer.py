"""A seed's tokenizer without torch or transformers: token ids and offsets from the tokenizers library, prompts from
the chat template rendered by jinja2 as transformers renders it, and the tokenizer's identity.

A tokenizer saved by transformers 5 as ``TokenizersBackend`` (both committed seeds, every seed coop builds or imports)
is its tokenizer.json as the tokenizers library reads it: transformers adds nothing to it. Any other tokenizer (a
hub folder's ``GPT2Tokenizer``, which transformers rebuilds from its vocabulary) is built by transformers, and its
backend used the same way. tests/unit/test_seedtokenizer.py checks both against transformers."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from experiment.core.canonical import identity, sha256_bytes, sha256_file
from experiment.core.errors import CoopError

BACKEND_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES), in its order.
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The tokenizer_config.json keys whose effect this module reproduces (or that change no token id or text). A config
# with any other key (add_bos_token, added_tokens_decoder, a post_processor, ...) is built by transformers instead.
READ_KEYS = frozenset(
    {
        "backend",
        "tokenizer_class",
        *NAMED_TOKENS,
        "extra_special_tokens",
        "additional_special_tokens",
        "chat_template",
        "clean_up_tokenization_spaces",
        "split_special_tokens",
        "model_max_length",
        "model_input_names",
        "padding_side",
        "truncation_side",
    }
)
LARGEST_READ_VOCABULARY = 100_000  # above it, transformers may patch a Mistral tokenizer's pre-tokenizer regex


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (its _compile_jinja_template), less the
    ``{% generation %}`` tag, which only marks assistant tokens."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    return environment


@dataclass(frozen=True)
class SeedTokenizer:
    """What the experiment reads of a seed's tokenizer: its backend (a ``tokenizers.Tokenizer``), its one chat
    template, and its special tokens as transformers names them."""

    directory: Path
    backend: Any  # tokenizers.Tokenizer (untyped)
    chat_template: str
    special_tokens_map: dict[str, str]  # the named ones (eos_token, pad_token, ...), which the template may read
    all_special_tokens: list[str]  # named and extra, each once, as transformers' all_special_tokens lists them

    @property
    def eos_token(self) -> str:
        return self.special_tokens_map["eos_token"]

    @cached_property
    def eos_id(self) -> int:
        return self._id("eos_token")

    @cached_property
    def pad_id(self) -> int:
        return self._id("pad_token")

    def _id(self, name: str) -> int:
        token = self.special_tokens_map.get(name)
        found = None if token is None else self.backend.token_to_id(token)
        if found is None:
            raise CoopError(f"the tokenizer in {self.directory} has no {name} in its vocabulary")
        return int(found)

    @cached_property
    def _template(self) -> jinja2.Template:
        return _environment().from_string(self.chat_template)

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
        """The conversation as the chat template writes it (transformers' apply_chat_template, tokenize=False)."""
        if not messages:
            raise CoopError("an empty conversation has no rendering")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens_map,
            )
        except jinja2.TemplateError as exc:
            raise CoopError(f"the chat template in {self.directory} does not render: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``, no special tokens added (transformers' ``tokenizer(text,
        add_special_tokens=False)``)."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The token ids of ``text`` and each one's character span in it."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        return list(encoding.ids), [(int(first), int(last)) for first, last in encoding.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included (transformers' ``decode(ids, skip_special_tokens=False)``)."""
        return str(self.backend.decode(list(ids), skip_special_tokens=False))


def _token(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _config(directory: Path) -> dict[str, Any] | None:
    path = directory / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CoopError(f"cannot read {path}: {exc}") from exc
    return config if isinstance(config, dict) else None


def _template_of(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The one chat template transformers reads (chat_template.jinja before the config's); None if there are
    several or none."""
    if (directory / "additional_chat_templates").exists():
        return None
    path = directory / TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _read_directly(directory: Path, config: Mapping[str, Any] | None) -> SeedTokenizer | None:
    """The tokenizer from its files alone, when transformers would use tokenizer.json unchanged; else None."""
    if config is None or config.get("tokenizer_class") != "TokenizersBackend" or not config.keys() <= READ_KEYS:
        return None
    if config.get("backend", "tokenizers") != "tokenizers":
        return None
    named = {name: _token(config[name]) for name in NAMED_TOKENS if config.get(name) is not None}
    extra_tokens = config.get("extra_special_tokens", config.get("additional_special_tokens", []))
    extra = [_token(t) for t in extra_tokens] if isinstance(extra_tokens, list) else [None]
    template = _template_of(directory, config)
    if None in named.values() or None in extra or template is None:
        return None
    try:
        backend = tokenizers.Tokenizer.from_file(str(directory / BACKEND_FILE))
    except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
        raise CoopError(f"cannot load the tokenizer from {directory}: {exc}") from exc
    added = {str(token.content) for token in backend.get_added_tokens_decoder().values()}
    specials = [str(t) for t in named.values()] + [str(t) for t in extra]
    if backend.post_processor is None or backend.get_vocab_size() > LARGEST_READ_VOCABULARY or set(specials) - added:
        return None  # transformers would add a post-processor, patch the regex or add the special tokens
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None  # transformers would clean up the spaces of a decoding
    # As transformers encodes: truncation and padding off, special tokens split only when configured.
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    return SeedTokenizer(
        directory=directory,
        backend=backend,
        chat_template=template,
        special_tokens_map={name: str(token) for name, token in named.items()},
        all_special_tokens=list(dict.fromkeys(specials)),
    )


def load_transformers_tokenizer(directory: Path) -> Any:
    """transformers' tokenizer of a seed folder (a ``PreTrainedTokenizerBase``): a host's, as it imports
    transformers."""
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CoopError(f"cannot load the tokenizer from {directory}: {exc}") from exc
    if not tokenizer.chat_template:
        raise CoopError(f"the tokenizer in {directory} has no chat_template")
    if tokenizer.eos_token is None:
        raise CoopError(f"the tokenizer in {directory} has no eos_token")
    return tokenizer


def _read_through_transformers(directory: Path) -> SeedTokenizer:
    tokenizer = load_transformers_tokenizer(directory)
    template = tokenizer.chat_template
    if not isinstance(template, str):
        raise CoopError(f"the tokenizer in {directory} has several chat templates; expected one")
    backend = tokenizer.backend_tokenizer
    if tokenizer.clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE":
        raise CoopError(f"the tokenizer in {directory} cleans up spaces when it decodes; coop decodes without")
    backend.no_truncation()
    backend.no_padding()
    return SeedTokenizer(
        directory=directory,
        backend=backend,
        chat_template=template,
        special_tokens_map={str(k): str(v) for k, v in tokenizer.special_tokens_map.items()},
        all_special_tokens=[str(t) for t in tokenizer.all_special_tokens],
    )


def read_tokenizer(directory: Path) -> SeedTokenizer:
    """The tokenizer of a seed folder: read from its files where they are all transformers reads, else built by
    transformers."""
    if not (directory / BACKEND_FILE).is_file():
        raise CoopError(f"seed directory {directory} has no {BACKEND_FILE}")
    config = _config(directory)
    direct = _read_directly(directory, config)
    if direct is None:
        return _read_through_transformers(directory)
    if not direct.chat_template:
        raise CoopError(f"the tokenizer in {directory} has no chat_template")
    if "eos_token" not in direct.special_tokens_map:
        raise CoopError(f"the tokenizer in {directory} has no eos_token")
    return direct


def tokenizer_identity(directory: Path) -> str:
    """Identity of everything that decides token ids: backend JSON, chat template, special and EOS tokens."""
    tokenizer = read_tokenizer(directory)
    return identity(
        {
            "tokenizer_json": sha256_file(directory / BACKEND_FILE),
            "chat_template": sha256_bytes(tokenizer.chat_template.encode("utf-8")),
            "special_tokens": sorted(tokenizer.all_special_tokens),
            "eos_token": tokenizer.eos_token,
        }
    )
