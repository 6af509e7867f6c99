"""A Hugging Face ``config.json``, parsed once into a frozen dataclass.

Both spellings of RoPE settings are read: the classic ``rope_theta`` +
``rope_scaling`` pair (what Llama-3 and Qwen3 checkpoints ship) and the
``rope_parameters`` dict that transformers 5 writes. ``torch_dtype`` and its newer
name ``dtype`` are both read. Fields the dense families do not use stay available
in :attr:`HFModelConfig.raw`, so later families (MoE, MLA) parse their extras from
there without this module growing a field per model.

Invariant: an :class:`HFModelConfig` that exists has been validated: positive
sizes, ``num_attention_heads`` a multiple of ``num_key_value_heads``, a known
RoPE type with all of its parameters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pdserve.layers.rotary import ROPE_TYPES, RopeScaling

CONFIG_FILE = "config.json"

__all__ = ["CONFIG_FILE", "HFModelConfig", "RopeScaling", "load_hf_config"]


@dataclass(frozen=True)
class HFModelConfig:
    """The fields of ``config.json`` the dense decoder families need (see module doc)."""

    path: Path  # the config.json this came from (for error messages)
    architectures: tuple[str, ...]
    model_type: str | None
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def architecture(self) -> str:
        """The first listed architecture (the one the registry resolves)."""
        return self.architectures[0]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: Path | str = CONFIG_FILE) -> HFModelConfig:
        """Validate ``d`` (the parsed JSON of ``path``); raise ``ValueError`` naming the key."""
        p = _Parser(d, Path(path))
        archs = d.get("architectures")
        if archs is None:
            raise ValueError(f"{path}: required key 'architectures' is missing")
        if (
            not isinstance(archs, list)
            or not archs
            or not all(isinstance(a, str) and a for a in archs)
        ):
            raise ValueError(
                f"{path}: 'architectures' must be a non-empty list of names, got {archs!r}"
            )
        hidden = p.pos_int("hidden_size")
        heads = p.pos_int("num_attention_heads")
        kv_heads = p.pos_int("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ValueError(
                f"{path}: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        if d.get("head_dim") is None and hidden % heads:
            raise ValueError(
                f"{path}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) "
                "and no head_dim is given"
            )
        head_dim = p.pos_int("head_dim", default=hidden // heads)
        max_pos = p.pos_int("max_position_embeddings", default=2048)
        rope_theta, rope_scaling = _parse_rope(d, Path(path))
        return cls(
            path=Path(path),
            architectures=tuple(archs),
            model_type=p.opt_str("model_type"),
            hidden_size=hidden,
            num_hidden_layers=p.pos_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=p.pos_int("intermediate_size"),
            vocab_size=p.pos_int("vocab_size"),
            rms_norm_eps=p.pos_float("rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=p.flag("tie_word_embeddings", default=False),
            attention_bias=p.flag("attention_bias", default=False),
            mlp_bias=p.flag("mlp_bias", default=False),
            hidden_act=p.opt_str("hidden_act") or "silu",
            torch_dtype=p.opt_str("torch_dtype") or p.opt_str("dtype"),
            bos_token_id=p.opt_token_id("bos_token_id"),
            eos_token_ids=p.token_ids("eos_token_id"),
            raw=MappingProxyType(dict(d)),
        )


def load_hf_config(model_dir: str | Path) -> HFModelConfig:
    """Read and validate ``<model_dir>/config.json``."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"no {CONFIG_FILE} in model directory {model_dir} (looked for {path})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return HFModelConfig.from_dict(data, path)


class _Parser:
    """Typed accessors over one config dict; every error names the file and the key."""

    def __init__(self, d: Mapping[str, Any], path: Path) -> None:
        self.d = d
        self.path = path

    def _get(self, key: str, default: Any) -> Any:
        value = self.d.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ValueError(f"{self.path}: required key {key!r} is missing")
            return default
        return value

    def pos_int(self, key: str, default: Any = None) -> int:
        value = self._get(key, _REQUIRED if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{self.path}: {key!r} must be a positive integer, got {value!r}")
        return value

    def pos_float(self, key: str, default: float) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{self.path}: {key!r} must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.path}: {key!r} must be true or false, got {value!r}")
        return value

    def opt_str(self, key: str) -> str | None:
        value = self.d.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{self.path}: {key!r} must be a string, got {value!r}")
        return value

    def opt_token_id(self, key: str) -> int | None:
        ids = self.token_ids(key)
        if len(ids) > 1:
            raise ValueError(f"{self.path}: {key!r} must be one token id, got {list(ids)}")
        return ids[0] if ids else None

    def token_ids(self, key: str) -> tuple[int, ...]:
        value = self.d.get(key)
        if value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(
                    f"{self.path}: {key!r} must be a token id or a list of them, got {value!r}"
                )
        return tuple(values)


_REQUIRED = object()


def _parse_rope(d: Mapping[str, Any], path: Path) -> tuple[float, RopeScaling | None]:
    """Return (rope_theta, scaling) from either the classic or the transformers-5 spelling."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{path}: 'rope_parameters' must be an object, got {params!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"{path}: 'rope_scaling' must be an object or null, got {scaling!r}")
    theta = d.get("rope_theta")
    if theta is None and params is not None:
        theta = params.get("rope_theta")
    if theta is None:
        theta = 10000.0
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise ValueError(f"{path}: 'rope_theta' must be a positive number, got {theta!r}")
    spec = scaling if scaling is not None else params
    if spec is None:
        return float(theta), None
    key = "rope_scaling" if scaling is not None else "rope_parameters"
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{path}: {key}.rope_type {rope_type!r} is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None

    def num(name: str) -> float:
        value = spec.get(name)
        if value is None:
            raise ValueError(f"{path}: {key} of type {rope_type!r} needs {name!r}")
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ValueError(f"{path}: {key}.{name} must be a number, got {value!r}")
        return float(value)

    factor = num("factor")
    if factor < 1.0:
        raise ValueError(f"{path}: {key}.factor must be >= 1, got {factor}")
    if rope_type == "linear":
        return float(theta), RopeScaling("linear", factor)
    if rope_type == "llama3":
        low, high = num("low_freq_factor"), num("high_freq_factor")
        if not 0 < low < high:
            raise ValueError(
                f"{path}: {key} needs 0 < low_freq_factor < high_freq_factor, got {low} and {high}"
            )
    original = int(num("original_max_position_embeddings"))
    if original <= 0:
        raise ValueError(f"{path}: {key}.original_max_position_embeddings must be positive")
    if rope_type == "yarn":

        def opt(name: str, default: float | None) -> float | None:
            return num(name) if spec.get(name) is not None else default

        truncate = spec.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"{path}: {key}.truncate must be true or false, got {truncate!r}")
        return float(theta), RopeScaling(
            "yarn",
            factor,
            original_max_position_embeddings=original,
            beta_fast=opt("beta_fast", 32.0) or 32.0,
            beta_slow=opt("beta_slow", 1.0) or 1.0,
            mscale=opt("mscale", None),
            mscale_all_dim=opt("mscale_all_dim", None),
            attention_factor=opt("attention_factor", None),
            truncate=truncate,
        )
    return float(theta), RopeScaling("llama3", factor, low, high, original)
