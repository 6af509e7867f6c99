"""The config fields of the DeepSeek-V3 / V3.2 and GLM-5 family, read from ``config.json``.

:class:`HFModelConfig` keeps every field it does not know in ``raw``; this module reads
the family's fields from there once, validated, with errors that name the file and the
field. Layer plans:

- ``mlp_layer_types`` (HF writes it) or ``first_k_dense_replace``: which layers are dense.
- ``indexer_types`` (HF writes it), else ``index_topk_pattern`` ("F" full, "S" shared),
  else ``index_topk_freq`` / ``index_skip_topk_offset`` (GLM-5.2's index sharing: layer
  ``i`` is full iff ``max(i - offset + 1, 0) % freq == 0``). Every layer is full by default,
  and a model without ``index_topk`` (DeepSeek-V3) has no indexer at all.
- RoPE layout: GLM-5 interleaves both MLA and the indexer; DeepSeek-V3.2 interleaves MLA
  and half-splits the indexer; DeepSeek-V3 follows ``rope_interleave`` (default true).
  ``rope_interleave`` / ``indexer_rope_interleave`` override when present.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.models.hf_config import HFModelConfig

GLM_TYPES = ("glm_moe_dsa",)
INDEXED_TYPES = ("glm_moe_dsa", "deepseek_v32")


@dataclass(frozen=True)
class DeepseekConfig:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]
    # DSA (None / empty when the model has no indexer)
    index_topk: int | None
    index_n_heads: int
    index_head_dim: int
    indexer_types: tuple[str, ...]
    rope_interleave: bool
    indexer_rope_interleave: bool
    num_nextn_predict_layers: int
    index_share_for_mtp_iteration: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        return self.index_topk is not None


def read_deepseek_config(hc: HFModelConfig) -> DeepseekConfig:
    raw = hc.raw
    path = hc.path
    n = hc.num_hidden_layers

    def field(
        name: str, kind: type | tuple[type, ...], default: Any = ..., positive: bool = False
    ) -> Any:
        value: Any = raw.get(name, default)
        if value is ...:
            raise ValueError(f"{path}: required key {name!r} is missing")
        if value is None and default is None:
            return None
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise ValueError(f"{path}: {name!r} must be {_kind_name(kind)}, got {value!r}")
        if not isinstance(value, kind):
            raise ValueError(f"{path}: {name!r} must be {_kind_name(kind)}, got {value!r}")
        if positive and not (isinstance(value, int | float) and value > 0):
            raise ValueError(f"{path}: {name!r} must be positive, got {value!r}")
        return value

    mtype = hc.model_type or ""
    is_glm = mtype in GLM_TYPES
    indexed = mtype in INDEXED_TYPES
    dense: int = min(field("first_k_dense_replace", int, 0), n)
    mlp_types = _layer_list(raw, path, "mlp_layer_types", n, ("dense", "sparse"))
    if mlp_types is None:
        mlp_types = ("dense",) * dense + ("sparse",) * (n - dense)
    index_topk = field("index_topk", int, None, positive=True) if indexed else None
    indexer_types: tuple[str, ...] = ()
    if index_topk is not None:
        indexer_types = _indexer_types(raw, path, n)
    rope_interleave = field("rope_interleave", bool, True)
    return DeepseekConfig(
        q_lora_rank=field("q_lora_rank", int, None, positive=True),
        kv_lora_rank=field("kv_lora_rank", int, positive=True),
        qk_nope_head_dim=field("qk_nope_head_dim", int, positive=True),
        qk_rope_head_dim=field("qk_rope_head_dim", int, positive=True),
        v_head_dim=field("v_head_dim", int, positive=True),
        n_routed_experts=field("n_routed_experts", int, positive=True),
        n_shared_experts=field("n_shared_experts", int, 0),
        num_experts_per_tok=field("num_experts_per_tok", int, positive=True),
        moe_intermediate_size=field("moe_intermediate_size", int, positive=True),
        n_group=field("n_group", int, 1, positive=True),
        topk_group=field("topk_group", int, 1, positive=True),
        norm_topk_prob=field("norm_topk_prob", bool, True),
        routed_scaling_factor=float(field("routed_scaling_factor", (int, float), 1.0)),
        mlp_layer_types=mlp_types,
        index_topk=index_topk,
        index_n_heads=field("index_n_heads", int, 64, positive=True) if indexed else 0,
        index_head_dim=field("index_head_dim", int, 128, positive=True) if indexed else 0,
        indexer_types=indexer_types,
        rope_interleave=rope_interleave,
        indexer_rope_interleave=field("indexer_rope_interleave", bool, is_glm),
        num_nextn_predict_layers=field("num_nextn_predict_layers", int, 0),
        index_share_for_mtp_iteration=field("index_share_for_mtp_iteration", bool, False),
    )


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(
        {int: "an integer", float: "a number", bool: "true or false"}.get(k, k.__name__)
        for k in kinds
    )


def _layer_list(
    raw: Any, path: Any, name: str, n: int, allowed: tuple[str, ...]
) -> tuple[str, ...] | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) < n or any(v not in allowed for v in value):
        raise ValueError(
            f"{path}: {name!r} must list one of {', '.join(allowed)} for each of the {n} layers, "
            f"got {value!r}"
        )
    return tuple(value[:n])


def _indexer_types(raw: Any, path: Any, n: int) -> tuple[str, ...]:
    explicit = _layer_list(raw, path, "indexer_types", n, ("full", "shared"))
    if explicit is not None:
        types = explicit
    elif raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        letters = {"F": "full", "S": "shared"}
        if not isinstance(pattern, str) or len(pattern) < n:
            raise ValueError(
                f"{path}: 'index_topk_pattern' must be a string of F/S letters, one per layer "
                f"({n}), got {pattern!r}"
            )
        bad = sorted({c for c in pattern if c not in letters})
        if bad:
            raise ValueError(
                f"{path}: 'index_topk_pattern' has unknown letter(s) {', '.join(bad)} "
                "(F: full indexer, S: shared with the previous full layer)"
            )
        types = tuple(letters[c] for c in pattern[:n])
    else:
        freq = raw.get("index_topk_freq", 1)
        offset = raw.get("index_skip_topk_offset", 2)
        for name, v in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{path}: {name!r} must be a non-negative integer, got {v!r}")
        freq = max(freq, 1)
        types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n))
    if types and types[0] != "full":
        raise ValueError(f"{path}: the first layer must run its own indexer ('full')")
    return types
