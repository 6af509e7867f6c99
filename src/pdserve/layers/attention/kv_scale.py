"""Static per-layer scales of an FP8 KV cache (``--kv-cache-dtype fp8``).

A cache owner that can keep its cache in float8_e4m3fn (GQA attention, MLA) holds one
scale for K and one for V, fixed when the weights load (before any CUDA graph is
captured, so graphs bake them in): the cache stores ``x / scale`` saturated into e4m3 and
``stored * scale`` is what attention reads. The backends fold the read side into scalars
they already have: K's scale multiplies the softmax scale, V's scale multiplies the
attention output; only the write divides. MLA keeps the latent and the rotated key in one
row, so it has one scale (its ``k_scale``; a ``v_scale`` must equal it or be absent).

Where the scales come from: a checkpoint's scalar ``<attention module>.k_scale`` and
``.v_scale`` tensors (see :mod:`pdserve.models.kv_scales`); without them both are 1.0.
With a cache in the model dtype they are ignored (1.0), as vLLM ignores them there.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from pdserve.kernels.reference import FP8_DTYPE

MIN_KV_SCALE = 1e-6  # the smallest scale calibration writes (an all-zero layer)


class FP8CacheScales:
    """Mixin of the cache owners that can read an FP8 cache: their ``k_scale`` and
    ``v_scale`` as a checkpoint gave them (None: not given)."""

    supports_fp8_cache = True
    single_kv_scale = False  # MLA: one row, one scale
    layer_name: str  # set by the runner (see CacheOwner)
    k_scale: float | None = None
    v_scale: float | None = None

    def set_kv_scale(self, which: Literal["k", "v"], value: float, name: str) -> None:
        """Record a checkpoint scale; ``name`` (the tensor's) goes into every error."""
        if not math.isfinite(value) or value <= 0.0:
            raise ValueError(f"tensor {name!r}: a KV cache scale must be positive, got {value}")
        other = self.v_scale if which == "k" else self.k_scale
        if self.single_kv_scale and other is not None and other != value:
            raise ValueError(
                f"tensor {name!r}: the MLA latent cache has one scale, but k_scale and "
                f"v_scale differ ({value if which == 'k' else other} and "
                f"{other if which == 'k' else value})"
            )
        setattr(self, f"{which}_scale", value)

    def kv_scales(self) -> tuple[float, float]:
        """(k, v) scales an FP8 cache of this layer is written and read with."""
        if self.single_kv_scale:
            s = self.k_scale if self.k_scale is not None else self.v_scale
            return (s or 1.0, s or 1.0)
        return (self.k_scale or 1.0, self.v_scale or 1.0)

    def has_kv_scales(self) -> bool:
        """Whether a checkpoint gave this layer a scale other than 1.0."""
        return self.kv_scales() != (1.0, 1.0)

    def cache_scales(self, cache: torch.Tensor) -> tuple[float, float]:
        """:meth:`kv_scales` for an FP8 ``cache``, (1.0, 1.0) for any other dtype."""
        return self.kv_scales() if cache.dtype == FP8_DTYPE else (1.0, 1.0)
