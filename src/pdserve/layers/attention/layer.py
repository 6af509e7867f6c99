"""The attention layer model code calls: projections happen in the model, this does the rest."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.runner.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention for layer ``layer_idx``; K/V of this step are written to its cache.

    Inputs are flat over the step's tokens: q [T, num_heads*head_dim], k and v
    [T, num_kv_heads*head_dim], already rotated. Output is [T, num_heads*head_dim].
    """

    def __init__(
        self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        t = q.shape[0]
        out = ctx.attn_backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            ctx.kv_caches[self.layer_idx],
            ctx.attn_metadata,
            self.scale,
        )
        return out.reshape(t, self.num_heads * self.head_dim)
