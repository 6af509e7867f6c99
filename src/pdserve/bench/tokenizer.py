"""A HuggingFace-compatible tokenizer view built on the ``tokenizers`` library only.

The benchmark needs five things from a tokenizer, with the meaning
``transformers``' fast tokenizers give them (the random dataset and the output
token fallback must agree with ``vllm bench serve``):

* ``vocab_size``: the base vocabulary, *without* added tokens;
* ``all_special_ids``: ids of the named special tokens of ``tokenizer_config.json``
  (bos/eos/unk/sep/pad/cls/mask, additional/extra special tokens), plus every
  added token flagged ``special`` in ``tokenizer.json`` (a safe superset);
* ``num_special_tokens_to_add()``: tokens the post-processor adds to one sequence;
* ``encode(text, add_special_tokens)`` and ``decode(ids)`` (special tokens kept,
  like ``transformers``' default).

The post-processor of ``tokenizer.json`` decides which special tokens a sequence
gets, as in ``transformers`` 5 (which then ignores ``add_bos_token``). Only when
``tokenizer.json`` has no post-processor are ``add_bos_token``/``add_eos_token`` of
``tokenizer_config.json`` turned into a ``[bos] $A [eos]`` template (the
``transformers`` 4 Llama behaviour). Truncation and padding stored in
``tokenizer.json`` are switched off, as ``transformers`` does per call.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer, processors

from pdserve.bench.errors import BenchError

_NAMED_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_LIST_SPECIAL_KEYS = ("additional_special_tokens", "extra_special_tokens")


class TokenizerLike(Protocol):
    """The subset of a HF tokenizer the benchmark uses."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    def num_special_tokens_to_add(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _clean_up_tokenization(text: str) -> str:
    """``transformers``' ``clean_up_tokenization`` (only used when the config asks)."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


class BenchTokenizer:
    """``tokenizers.Tokenizer`` plus ``tokenizer_config.json`` semantics (see module doc).

    Invariant: after construction the wrapped tokenizer has no truncation/padding
    and has a post-processor (tokenizer.json's, else one built from the config).
    """

    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, Any], name: str = "") -> None:
        self.name = name
        self._tok = tokenizer
        self._tok.no_truncation()
        self._tok.no_padding()
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))

        special_ids: set[int] = set()
        named: dict[str, str] = {}
        for key in _NAMED_SPECIAL_KEYS:
            content = _token_content(config.get(key))
            if content is not None:
                named[key] = content
        extra: list[str] = []
        for key in _LIST_SPECIAL_KEYS:
            value = config.get(key)
            items: list[Any] = []
            if isinstance(value, Mapping):
                items = list(value.values())
            elif isinstance(value, list):
                items = value
            extra.extend(c for c in (_token_content(v) for v in items) if c is not None)
        for content in [*named.values(), *extra]:
            tid = self._tok.token_to_id(content)
            if tid is not None:
                special_ids.add(tid)
        for tid, added in self._tok.get_added_tokens_decoder().items():
            if added.special:
                special_ids.add(tid)
        self._special_ids = sorted(special_ids)

        if self._tok.post_processor is None:
            self._set_template(
                bos=named.get("bos_token") if config.get("add_bos_token", False) else None,
                eos=named.get("eos_token") if config.get("add_eos_token", False) else None,
            )

    def _set_template(self, bos: str | None, eos: str | None) -> None:
        specials: list[tuple[str, int]] = []
        bos_id = self._tok.token_to_id(bos) if bos is not None else None
        eos_id = self._tok.token_to_id(eos) if eos is not None else None
        single = "$A:0"
        pair = "$A:0 $B:1"
        if bos is not None and bos_id is not None:
            single = f"{bos}:0 {single}"
            pair = f"{bos}:0 $A:0 {bos}:1 $B:1"
            specials.append((bos, bos_id))
        if eos is not None and eos_id is not None:
            single = f"{single} {eos}:0"
            pair = pair.replace("$A:0", f"$A:0 {eos}:0").replace("$B:1", f"$B:1 {eos}:1")
            specials.append((eos, eos_id))
        self._tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials
        )

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, added tokens excluded (HF ``vocab_size``)."""
        return int(self._tok.get_vocab_size(with_added_tokens=False))

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids that the random dataset must never sample."""
        return list(self._special_ids)

    def num_special_tokens_to_add(self) -> int:
        """Tokens added around a single sequence when ``add_special_tokens=True``."""
        return int(self._tok.num_special_tokens_to_add(False))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
        return _clean_up_tokenization(text) if self._clean_up else text


def _hf_cache_dirs() -> list[Path]:
    dirs: list[Path] = []
    if env := os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(env))
    if env := os.environ.get("HF_HOME"):
        dirs.append(Path(env) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def _from_hf_cache(repo_id: str) -> Path | None:
    """Find ``tokenizer.json`` of an already-downloaded hub model (no network)."""
    if repo_id.count("/") != 1:
        return None
    for cache in _hf_cache_dirs():
        repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
        snapshots = repo_dir / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo_dir / "refs" / "main"
        if ref.is_file():
            candidate = snapshots / ref.read_text().strip() / "tokenizer.json"
            if candidate.is_file():
                return candidate
        for snap in sorted(snapshots.iterdir()):
            if (snap / "tokenizer.json").is_file():
                return snap / "tokenizer.json"
    return None


def resolve_tokenizer_file(name_or_path: str) -> Path:
    """Map ``--tokenizer`` (folder, tokenizer.json path, or cached hub id) to tokenizer.json."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        candidate = path / "tokenizer.json"
        if candidate.is_file():
            return candidate
        raise BenchError(
            f"tokenizer folder {str(path)!r} has no tokenizer.json (only fast "
            "tokenizers saved as tokenizer.json are supported)"
        )
    cached = _from_hf_cache(name_or_path)
    if cached is not None:
        return cached
    raise BenchError(
        f"cannot find a tokenizer for {name_or_path!r}: pass --tokenizer with a local "
        "model folder containing tokenizer.json (hub ids are only looked up in the "
        "local HuggingFace cache, never downloaded)"
    )


def load_tokenizer(name_or_path: str) -> BenchTokenizer:
    """Load ``tokenizer.json`` and, when present beside it, ``tokenizer_config.json``."""
    file = resolve_tokenizer_file(name_or_path)
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust error type is not exported
        raise BenchError(f"failed to load tokenizer {str(file)!r}: {exc}") from exc
    config: dict[str, Any] = {}
    config_file = file.parent / "tokenizer_config.json"
    if config_file.is_file():
        try:
            loaded = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise BenchError(f"failed to read {str(config_file)!r}: {exc}") from exc
        if isinstance(loaded, dict):
            config = loaded
    return BenchTokenizer(tok, config, name=name_or_path)
