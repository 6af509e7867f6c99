"""Plain-torch references of the fused kernels, and what the layers run without them.

This module imports torch only (never triton), so layers and the sampler use these
functions on machines without Triton, and every kernel module imports its reference
from here: one floor down, no cycle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; statistics in float32, the normalised value cast
    back to the input dtype before the weight multiply (Hugging Face Llama's order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] by per-token ``cos``/``sin`` [T, D/2] (half-rotation layout).

    Same arithmetic as HF's ``x * cos + rotate_half(x) * sin`` element for element.
    """
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] where dimensions (2i, 2i+1) form pair i (GPT-J /
    DeepSeek layout), by ``cos``/``sin`` [T, D/2]. The output holds the rotated even
    dimensions, then the rotated odd ones (HF's ``apply_rotary_pos_emb_interleave``):
    a fixed permutation of the GPT-J output, so dot products between two rotated
    vectors are the same, and both ends of a KV transfer agree on it."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` with torch ops."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) set with -inf."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        sorted_logits = sorted_logits.masked_fill(cum > top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, idx, sorted_logits)
