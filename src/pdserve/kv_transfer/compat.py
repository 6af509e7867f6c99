"""The handshake's compatibility description: what must match for KV bytes to be reusable.

Both sides build the same dict from their own configuration; the consumer compares
field by field and refuses a mismatch with a message naming the field, so a wrong
pairing never silently produces garbage.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

CONNECTOR_VERSION = 4  # 3: authenticated side channel (wire.py envelope); 4: sessions, bound reads


def compat_info(
    *,
    model_config: dict[str, Any],
    kv_cache: list[dict[str, Any]],
    block_size: int,
    speculative: dict[str, Any] | None,
    transport: str,
    kv_cache_scales: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """Fields that must be equal on both ends: ``kv_cache`` describes every cache group
    (kind, dtype, one block's shape and block axis, its layers), as
    :meth:`KVCacheConfig.describe` gives it; ``kv_cache_dtype`` repeats each group's
    dtype on its own so a ``--kv-cache-dtype`` mismatch (fp8 against bf16: the same
    bytes would be read as other numbers) is refused under that name. ``kv_cache_scales``
    (every fp8 cache layer's [k_scale, v_scale]) travels as a digest: fp8 bytes written
    with one scale and read with another decode wrong just as silently."""
    arch = json.dumps(
        {
            k: model_config.get(k)
            for k in sorted(model_config)
            if k not in ("_name_or_path", "transformers_version")
        },
        sort_keys=True,
        default=str,
    )
    return {
        "connector_version": CONNECTOR_VERSION,
        "model_config_hash": hashlib.sha256(arch.encode()).hexdigest()[:16],
        "block_size": block_size,
        "kv_cache": kv_cache,
        "kv_cache_dtype": {g.get("group"): g.get("dtype") for g in kv_cache},
        "kv_cache_scales": kv_scales_digest(kv_cache_scales or {}),
        "speculative_config": speculative,
        "transport": transport,
    }


def kv_scales_digest(scales: Mapping[str, Sequence[float]]) -> str:
    """``"none"`` without fp8 cache layers, else a short sha256 of the per-layer scales
    (exact float values, layers sorted by name) and how many layers it covers."""
    if not scales:
        return "none"
    data = json.dumps({k: [float(x) for x in v] for k, v in scales.items()}, sort_keys=True)
    return f"sha256:{hashlib.sha256(data.encode()).hexdigest()[:16]} over {len(scales)} layers"


def compat_hash(info: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()[:16]


def compat_mismatch(local: dict[str, Any], remote: dict[str, Any]) -> str | None:
    """A message naming every field that differs, or None when compatible."""
    diffs = [
        f"{k} (prefill {remote.get(k)!r}, decode {local.get(k)!r})"
        for k in sorted(set(local) | set(remote))
        if local.get(k) != remote.get(k)
    ]
    if not diffs:
        return None
    hint = ""
    if local.get("kv_cache_scales") != remote.get("kv_cache_scales"):
        hint = (
            " (kv_cache_scales: the per-layer fp8 KV cache k_scale/v_scale; load both "
            "instances from the same checkpoint, with the same kv_cache_scales.safetensors)"
        )
    return (
        "KV transfer refused, the instances are not compatible: "
        + "; ".join(diffs)
        + " differ"
        + hint
    )
