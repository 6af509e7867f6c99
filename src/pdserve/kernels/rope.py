"""Neox-style (rotate-half) rotary embedding for q and k, in place, one launch.

Layout: ``q`` [T, H*D] (or [T, H, D]) and ``k`` [T, Hkv*D], each row's heads
contiguous with unit inner stride (views of a fused qkv projection are fine: the
row stride is free). ``cos_cache``/``sin_cache`` are the two tables that
:class:`pdserve.layers.rotary.RotaryEmbedding` holds, each [max_pos, rot/2]; the
first ``rot`` dims of every head are rotated (dim ``i < rot/2`` paired with
``i + rot/2``), dims past ``rot`` are left as they are (``rot = head_dim`` for
Llama). Positions out of the table are the caller's bug, as in the torch path.

Numerics match :func:`pdserve.kernels.reference.apply_rotary` bit for bit for bf16
and fp16 on the compiled path: each product is rounded to the input dtype, then
the difference/sum is rounded again (what torch does for ``x1*c - x2*s`` in a
16-bit dtype). No host syncs; the grid depends only on shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import check_device, next_pow2, pdl_args, pdl_enter
from pdserve.kernels.reference import apply_rotary


@triton.jit
def _rotate(base, offs, h_ok, c, s, HALF: tl.constexpr, ROUND: tl.constexpr):
    mask = h_ok[:, None] & (offs[None, :] < HALF)
    p1 = base + offs[None, :]
    x1r = tl.load(p1, mask=mask, other=0.0)
    x2r = tl.load(p1 + HALF, mask=mask, other=0.0)
    dt = x1r.dtype
    x1 = x1r.to(tl.float32)
    x2 = x2r.to(tl.float32)
    if ROUND:
        y1 = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
        y2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    else:
        y1 = (x1 * c - x2 * s).to(dt)
        y2 = (x2 * c + x1 * s).to(dt)
    tl.store(p1, y1, mask=mask)
    tl.store(p1 + HALF, y2, mask=mask)


@triton.jit
def load_pairs(base, offs, mask, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The (x1, x2) tiles of the rotation pairs of the rows at ``base`` (a pointer tile
    [rows, 1]; ``offs`` [BLOCK_HALF] pair indices): dims (2i, 2i+1) when ``INTERLEAVED``
    (GPT-J / DeepSeek), (i, i + HALF) otherwise (neox)."""
    if INTERLEAVED:
        p1 = base + 2 * offs[None, :]
        p2 = p1 + 1
    else:
        p1 = base + offs[None, :]
        p2 = p1 + HALF
    return tl.load(p1, mask=mask, other=0.0), tl.load(p2, mask=mask, other=0.0)


@triton.jit
def rotate_pairs(x1r, x2r, c, s, ROUND: tl.constexpr):
    """(x1 c - x2 s, x2 c + x1 s) in the inputs' dtype; ``ROUND``: each product rounded
    to that dtype first, as torch computes it in a 16-bit dtype. Either layout stores
    the first at dims [0, HALF) of the rotated part and the second at [HALF, 2 HALF)
    (HF's order for the interleaved layout too)."""
    dt = x1r.dtype
    x1 = x1r.to(tl.float32)
    x2 = x2r.to(tl.float32)
    if ROUND:
        y1 = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
        y2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    else:
        y1 = (x1 * c - x2 * s).to(dt)
        y2 = (x2 * c + x1 * s).to(dt)
    return y1, y2


@triton.jit
def load_cos_sin(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, offs, HALF: tl.constexpr):
    """cos and sin rows [1, BLOCK_HALF] (float32) of position ``pos``."""
    ok = offs < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sin + offs, mask=ok, other=0.0).to(tl.float32)
    return c[None, :], s[None, :]


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_kt,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    HEAD_D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUND: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    c_ok = offs < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + offs, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_off = heads.to(tl.int64) * HEAD_D
    q_base = q_ptr + t * stride_qt + head_off[:, None]
    k_base = k_ptr + t * stride_kt + head_off[:, None]
    _rotate(q_base, offs, heads < num_q_heads, c, s, HALF, ROUND)
    _rotate(k_base, offs, heads < num_k_heads, c, s, HALF, ROUND)


def _as_rows(x: torch.Tensor, head_dim: int, what: str) -> tuple[int, int]:
    """(row stride, heads) of ``x`` laid out as [T, heads*head_dim] with contiguous rows."""
    if x.dim() == 3:
        if x.shape[2] != head_dim or x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError(f"{what} [T, H, D] needs contiguous heads of size {head_dim}")
        return x.stride(0), x.shape[1]
    if x.dim() != 2 or x.shape[1] % head_dim or x.stride(1) != 1:
        raise ValueError(f"{what} must be [T, heads*{head_dim}] with unit inner stride")
    return x.stride(0), x.shape[1] // head_dim


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` IN PLACE by ``positions`` [T]; returns them for chaining."""
    check_device(q, "apply_rope")
    t = positions.shape[0]
    half = cos_cache.shape[-1]
    if 2 * half > head_dim or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin tables {tuple(cos_cache.shape)} do not fit head_dim {head_dim}")
    if cos_cache.stride(-1) != 1 or sin_cache.stride(-1) != 1:
        raise ValueError("cos/sin tables need unit inner stride")
    sq, hq = _as_rows(q, head_dim, "q")
    sk, hk = _as_rows(k, head_dim, "k")
    if t == 0:
        return q, k
    block_half = next_pow2(half)
    block_h = min(next_pow2(max(hq, hk)), max(1, 4096 // block_half))
    grid = (t, triton.cdiv(max(hq, hk), block_h))
    _rope_kernel[grid](
        q,
        k,
        positions,
        cos_cache,
        sin_cache,
        sq,
        sk,
        cos_cache.stride(0),
        sin_cache.stride(0),
        hq,
        hk,
        HEAD_D=head_dim,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=block_h,
        ROUND=q.dtype != torch.float32,
        num_warps=4,
        enable_fp_fusion=False,  # an FMA would skip the product's rounding
        **pdl_args(q.device),
    )
    return q, k


def apply_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place reference: the model's :func:`apply_rotary` on the first ``rot`` dims."""
    cos, sin = cos_cache[positions], sin_cache[positions]
    rot = 2 * cos.shape[-1]

    def one(x: torch.Tensor) -> torch.Tensor:
        x3 = x.reshape(x.shape[0], -1, head_dim)
        r = apply_rotary(x3[..., :rot], cos, sin)
        return torch.cat([r, x3[..., rot:]], dim=-1).reshape(x.shape)

    return one(q), one(k)
