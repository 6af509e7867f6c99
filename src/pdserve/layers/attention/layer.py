"""The GQA attention layer model code calls: projections happen in the model, this does the rest."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.core_types.cache_spec import CacheLayout
from pdserve.forward_context import get_forward_context
from pdserve.layers.attention.backend import GQABackend
from pdserve.layers.attention.kv_scale import FP8CacheScales
from pdserve.layers.attention.registry import gqa_backend
from pdserve.layers.rotary import RopeInputs


class Attention(FP8CacheScales, nn.Module):
    """Paged attention; K/V of this step are written to this layer's cache.

    Inputs are flat over the step's tokens: q [T, num_heads*head_dim], k and v
    [T, num_kv_heads*head_dim], already rotated, or rotated here given ``rope`` (the
    backend may fuse the rotation with its cache write; q and k are then rotated in
    place). Output is [T, num_heads*head_dim].
    The layer owns a cache of K and V per KV head (group ``cache_group``, layout
    ``[2, blocks, block_size, num_kv_heads, head_dim]``); ``layer_name`` is set by the
    runner when it allocates the caches. The cache may be float8_e4m3fn
    (``--kv-cache-dtype fp8``): ``k / k_scale`` and ``v / v_scale`` written saturated,
    read back times the scale, with static per-layer scales
    (:class:`~pdserve.layers.attention.kv_scale.FP8CacheScales`; 1.0 unless the
    checkpoint gives them).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        cache_group: str = "attn",
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.cache_group = cache_group
        self.layer_name = ""

    def kv_cache_layout(self, block_size: int, dtype: str) -> CacheLayout:
        return CacheLayout(
            "gqa", dtype, (2, 1, block_size, self.num_kv_heads, self.head_dim), block_axis=1
        )

    def make_backend(self, choice: str, device: torch.device, max_model_len: int) -> GQABackend:
        return gqa_backend(choice, device, max_model_len)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeInputs | None = None
    ) -> torch.Tensor:
        ctx = get_forward_context()
        t = q.shape[0]
        cache = ctx.kv_caches[self.layer_name]
        k_scale, v_scale = self.cache_scales(cache)
        out = ctx.backends[self.cache_group].forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            cache,
            ctx.attn_metadata[self.cache_group],
            self.scale,
            k_scale,
            v_scale,
            rope,
        )
        return out.reshape(t, self.num_heads * self.head_dim)
