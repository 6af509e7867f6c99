"""Tokenizer of an HF model directory, on the ``tokenizers`` library alone.

Reads ``tokenizer.json`` (the backend), ``tokenizer_config.json`` (named special
tokens, ``add_bos_token``/``add_eos_token``, chat template(s)), an optional
``chat_template.jinja`` (which wins over the config's template, as in
transformers), an optional ``special_tokens_map.json`` (fallback for the named
tokens) and an optional ``generation_config.json`` (extra end-of-sequence ids).

Behaviour matches ``transformers.AutoTokenizer`` for fast tokenizers:

* ``encode`` is the backend's encode: ``tokenizer.json``'s post-processor (e.g.
  Llama 3's BOS template) decides what ``add_special_tokens=True`` adds, and
  ``add_bos_token``/``add_eos_token`` in the config do not override it
  (transformers ≥ 5 drops them whenever ``tokenizer.json`` exists). Only when
  ``tokenizer.json`` has no post-processor are the flags honoured, building the
  ``[bos] $A [eos]`` template as transformers' Llama-family classes do (there
  transformers 5 would add nothing; we keep the model author's stated intent).
* ``decode`` is the backend's decode (skipping tokens flagged special);
  ``clean_up_tokenization_spaces`` is honoured except for BPE models, where
  transformers ignores it too.
* chat templates render in jinja2's ``ImmutableSandboxedEnvironment`` with
  ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a
  non-escaping ``tojson`` and the named special tokens as variables.

``max_chars_per_token`` bounds how many characters of input one token can stand for
(when the tokenizer has such a bound), so a caller can refuse a text that cannot fit a
context without encoding it.

Instances are immutable after construction (apart from that lazily computed bound) and
safe to share between threads; ``encode`` releases the GIL while the backend works.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _Backend

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# The named special tokens transformers knows, in its order.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """Encode, decode and chat-format text for one model (see module doc for the semantics)."""

    def __init__(
        self,
        backend: _Backend,
        special_tokens: Mapping[str, str] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        generation_eos_ids: Sequence[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._backend = backend
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        unknown = set(self._special) - set(SPECIAL_TOKEN_NAMES)
        if unknown:
            raise ValueError(f"unknown special token name(s) {sorted(unknown)}")
        missing = [t for t in self._special.values() if backend.token_to_id(t) is None]
        if missing:  # like transformers: named special tokens join the vocabulary
            backend.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in missing]
            )
        if backend.post_processor is None:
            backend.post_processor = self._template_processor(
                bool(add_bos_token), bool(add_eos_token)
            )
        self._templates: dict[str, str] = (
            {"default": chat_template}
            if isinstance(chat_template, str)
            else dict(chat_template or {})
        )
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        eos = {self.eos_token_id} if self.eos_token_id is not None else set()
        self._eos_ids = frozenset(eos | set(generation_eos_ids))
        added = backend.get_added_tokens_decoder()
        named = {self._backend.token_to_id(t) for t in self._special.values()}
        flagged = {i for i, tok in added.items() if tok.special}
        self._special_ids = sorted(i for i in named | flagged if i is not None)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load from an HF model directory (see module doc for the files read)."""
        root = Path(model_dir)
        tok_file = root / TOKENIZER_FILE
        if not tok_file.is_file():
            raise ValueError(f"no {TOKENIZER_FILE} in {root} (looked for {tok_file})")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ValueError(f"cannot parse {tok_file}: {e}") from e
        config = _read_json_object(root / TOKENIZER_CONFIG_FILE)
        fallback = _read_json_object(root / SPECIAL_TOKENS_MAP_FILE)
        special: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = config.get(name, fallback.get(name))
            token = _token_content(value, root / TOKENIZER_CONFIG_FILE, name)
            if token is not None:
                special[name] = token
        template: Any = config.get("chat_template")
        jinja_file = root / CHAT_TEMPLATE_FILE
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        generation = _read_json_object(root / GENERATION_CONFIG_FILE)
        return cls(
            backend,
            special_tokens=special,
            add_bos_token=_opt_bool(config, "add_bos_token", root / TOKENIZER_CONFIG_FILE),
            add_eos_token=_opt_bool(config, "add_eos_token", root / TOKENIZER_CONFIG_FILE),
            chat_template=_parse_templates(template, root / TOKENIZER_CONFIG_FILE),
            generation_eos_ids=_token_ids(
                generation.get("eos_token_id"), root / GENERATION_CONFIG_FILE
            ),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    def _template_processor(self, add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
        """The ``[bos] $A [eos]`` post-processor transformers builds from the two flags."""
        bos = self._special.get("bos_token") if add_bos else None
        eos = self._special.get("eos_token") if add_eos else None
        pre_a = f"{bos}:0 " if bos else ""
        post_a = f" {eos}:0" if eos else ""
        pre_b = f" {bos}:1" if bos else ""
        post_b = f" {eos}:1" if eos else ""
        single = f"{pre_a}$A:0{post_a}"
        pair = f"{single}{pre_b} $B:1{post_b}"
        tokens = [(t, self._backend.token_to_id(t)) for t in (bos, eos) if t is not None]
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)

    # ------------------------------------------------------------ token <-> text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode takes a string, got {type(text).__name__}")
        # the batch entry points release the GIL for the whole encode (``encode`` holds it
        # for part of it), and the fast one skips the offsets we never read
        fast = getattr(self._backend, "encode_batch_fast", None) or self._backend.encode_batch
        return list(fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int] | int, skip_special_tokens: bool = True) -> str:
        id_list = [ids] if isinstance(ids, int) else list(ids)
        text = self._backend.decode(id_list, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def convert_ids_to_tokens(
        self, ids: Sequence[int] | int, skip_special_tokens: bool = False
    ) -> list[str | None] | str | None:
        """Token strings for ids (``None`` for ids outside the vocabulary); an int gives one."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        special = set(self._special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int | None]:
        return [self._backend.token_to_id(t) for t in tokens]

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """An upper bound on the characters of input text one token stands for, or
        ``None`` when there is none (see :func:`max_chars_per_token`).
        ``ceil(len(text) / bound)`` is then a lower bound on ``len(encode(text))``."""
        return max_chars_per_token(self._backend)

    # ---------------------------------------------------------------- properties
    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer`` (treat as read-only)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len(hf_tokenizer)``)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens that are set, e.g. ``{"bos_token": "<s>", ...}``."""
        return dict(self._special)

    def _named_id(self, name: str) -> int | None:
        token = self._special.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(..., add_special_tokens=True)`` starts with the BOS token."""
        ids = self._backend.encode("", add_special_tokens=True).ids
        return self.bos_token_id is not None and bool(ids) and ids[0] == self.bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the tokenizer's eos ∪ ``generation_config.eos_token_id``."""
        return self._eos_ids

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of the named special tokens and of every added token flagged special."""
        return list(self._special_ids)

    @property
    def chat_template(self) -> str | None:
        """The default chat template, if any."""
        return self._templates.get("default")

    @property
    def chat_template_names(self) -> list[str]:
        return sorted(self._templates)

    # -------------------------------------------------------------- chat format
    def get_chat_template(
        self, chat_template: str | None = None, tools: list[dict[str, Any]] | None = None
    ) -> str:
        """Resolve a template: a name of one of ours, a template string, or our default."""
        if chat_template is not None:
            return self._templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if self._templates:
            raise ValueError(
                "this tokenizer has several chat templates and no default; pass one of "
                f"{self.chat_template_names} as chat_template"
            )
        raise ValueError(
            "this tokenizer has no chat template (tokenizer_config.json has no 'chat_template' "
            "and there is no chat_template.jinja); pass chat_template explicitly"
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt text (not tokenized; encode it with
        ``add_special_tokens=False``, the template already holds the BOS it wants)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        template = self.get_chat_template(chat_template, tools)
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self._special, **kwargs}
        try:
            return _compile(template).render(
                messages=plain,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e


# ------------------------------------------------------- characters per token
# How much a normalizer can shrink text: NFC/NFKC compose at most 4 characters into one
# (U+1F82 is 4 code points in NFD; Hangul LVT syllables are 3); the others never shrink
# it. Any other normalizer (Strip, StripAccents, BertNormalizer, Precompiled, ...) can
# drop characters: no bound.
_NORMALIZER_SHRINK = {
    "NFC": 4,
    "NFKC": 4,
    "NFD": 1,
    "NFKD": 1,
    "Lowercase": 1,
    "Prepend": 1,
    "ByteLevel": 1,
}
# pre-tokenizers that keep every character (Split and Punctuation unless "Removed")
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation", "FixedLength"}
)


def _state(component: Any) -> dict[str, Any] | None:
    """The JSON description of a normalizer / pre-tokenizer (``None`` when unset)."""
    if component is None:
        return None
    data = json.loads(component.__getstate__())
    return data if isinstance(data, dict) else {}


def _shrink_factor(norm: dict[str, Any] | None) -> int | None:
    if norm is None:
        return 1
    kind = norm.get("type")
    if kind == "Sequence":
        factor = 1
        for child in norm.get("normalizers", []):
            f = _shrink_factor(child)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern = norm.get("pattern", {})
        content = norm.get("content", "")
        if "String" in pattern and len(content) >= len(pattern["String"]) > 0:
            return 1
        return None
    return _NORMALIZER_SHRINK.get(str(kind))


def _pre_tokenizer_types(pre: dict[str, Any] | None) -> list[str] | None:
    """The pre-tokenizer types in order, or ``None`` if one of them drops characters."""
    if pre is None:
        return []
    kind = str(pre.get("type"))
    if kind == "Sequence":
        out: list[str] = []
        for child in pre.get("pretokenizers", []):
            sub = _pre_tokenizer_types(child)
            if sub is None:
                return None
            out += sub
        return out
    if kind not in _KEEPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
        return None
    return [kind]


def max_chars_per_token(backend: _Backend) -> int | None:
    """An upper bound on the characters of input text that one token of ``backend``
    stands for, or ``None`` when the tokenizer has none.

    The bound is the longest token string (added tokens included) times what the
    normalizer can shrink text by. It holds for a BPE model whose pipeline never drops
    a character: a normalizer of known shrink, pre-tokenizers that keep everything, no
    added token that swallows the whitespace around it, and every character reaching
    the model as known symbols (byte-level with the whole byte alphabet in the vocabulary,
    byte fallback with all 256 byte tokens, or an unknown token that is not fused). A
    byte-level token's string has one character per byte, and a character is at least
    one byte, so it stands for at most that many characters. Anything else (WordPiece,
    Unigram, WordLevel, fused unknowns, Strip or Bert normalizers, whitespace-removing
    pre-tokenizers) can turn an unbounded run of text into one token or none: ``None``.
    """
    model = backend.model
    if type(model).__name__ != "BPE":
        return None
    factor = _shrink_factor(_state(backend.normalizer))
    pre_types = _pre_tokenizer_types(_state(backend.pre_tokenizer))
    if factor is None or pre_types is None:
        return None
    added = backend.get_added_tokens_decoder().values()
    if any(t.lstrip or t.rstrip or t.single_word for t in added):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    if "ByteLevel" in pre_types:
        from tokenizers.pre_tokenizers import ByteLevel

        covered = all(c in vocab for c in ByteLevel.alphabet())
    elif getattr(model, "byte_fallback", False):
        covered = all(f"<0x{b:02X}>" in vocab for b in range(256))
    else:
        covered = getattr(model, "unk_token", None) in vocab and not getattr(
            model, "fuse_unk", True
        )
    if not covered or not vocab:
        return None
    return max(len(t) for t in vocab) * factor


# ---------------------------------------------------------------------- helpers
def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template is not valid jinja (line {e.lineno}): {e.message}") from e


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation and contractions)."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


def _read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when the (optional) file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, path: Path, name: str) -> str | None:
    """A special token is a string or an AddedToken dict ``{"content": ...}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise ValueError(
        f"{path}: {name!r} must be a string or an object with 'content', got {value!r}"
    )


def _opt_bool(config: Mapping[str, Any], key: str, path: Path) -> bool | None:
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{path}: {key!r} must be true or false, got {value!r}")
    return value


def _token_ids(value: Any, path: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(
            f"{path}: 'eos_token_id' must be a token id or a list of them, got {value!r}"
        )
    return values


def _parse_templates(value: Any, path: Path) -> str | dict[str, str] | None:
    """``chat_template`` is a string, or a list of ``{"name": ..., "template": ...}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        templates: dict[str, str] = {}
        for entry in value:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ValueError(
                    f"{path}: each chat_template entry must be {{'name': str, 'template': str}}, "
                    f"got {entry!r}"
                )
            templates[entry["name"]] = entry["template"]
        return templates
    raise ValueError(
        f"{path}: 'chat_template' must be a string or a list, got {type(value).__name__}"
    )
