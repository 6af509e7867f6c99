"""Scatter this step's K and V into the paged KV cache (:func:`write_kv_cache`), or rotate
q and k and scatter K and V in one launch (:func:`rope_write_kv`, the decode path).

Cache layout (shared with the torch backend): ``kv_cache[0]`` holds K and
``kv_cache[1]`` V, each [num_blocks, block_size, num_kv_heads, head_dim]; any
strides are accepted as long as ``head_dim`` is the innermost, unit-stride axis.
Token ``t`` goes to ``slot_mapping[t] = block * block_size + offset``. A negative
slot skips the token; slot 0 lies in the null block, where padded tokens may
write freely because nothing reads it. An fp8 cache stores ``k / k_scale`` and
``v / v_scale`` (per-layer static scales, host floats), saturated at +-448; the
attention kernels read it back through their softmax scale and output scale.

One program moves one token's ``[BLOCK_H, head_dim]`` tile of K and of V; there is
no host sync and the grid depends only on tensor shapes, so the launch can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import (
    check_device,
    interpret_mode,
    next_pow2,
    pdl_args,
    pdl_enter,
    round_to_e4m3,
)
from pdserve.kernels.reference import FP8_DTYPE, FP8_MAX, write_kv_reference
from pdserve.kernels.rope import load_cos_sin, load_pairs, rotate_pairs


@triton.jit
def _kv_cache_write_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_kv_heads,
    k_scale,
    v_scale,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // PAGE
        off = slot % PAGE
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_D)
        src = heads[:, None] * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + t * stride_kt + src, mask=mask)
        if FP8_MAX > 0:  # an fp8 cache: saturate (a plain cast turns overflow into NaN)
            k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
            if ROUND_FIRST:
                k = round_to_e4m3(k)
        dst = blk * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch + offs_d[None, :]
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        src = heads[:, None] * stride_vh + offs_d[None, :]
        v = tl.load(v_ptr + t * stride_vt + src, mask=mask)
        if FP8_MAX > 0:
            v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
            if ROUND_FIRST:
                v = round_to_e4m3(v)
        dst = blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch + offs_d[None, :]
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``k``/``v`` [T, Hkv, D] into ``kv_cache`` [2, blocks, block_size, Hkv, D].

    Only the first ``slot_mapping.shape[0]`` tokens are written (``k`` may be
    longer, e.g. graph-padded). ``slot_mapping`` is int64 (int32 works too). The
    scales divide what an fp8 cache stores (other dtypes ignore them).
    """
    check_device(kv_cache, "write_kv_cache")
    n = slot_mapping.shape[0]
    if n == 0:
        return
    if k.shape[0] < n or v.shape[0] < n:
        raise ValueError(f"slot_mapping has {n} tokens but k/v have {k.shape[0]}/{v.shape[0]}")
    _, _, page, hkv, d = kv_cache.shape
    if k.shape[1:] != (hkv, d) or v.shape[1:] != (hkv, d):
        raise ValueError(
            f"k/v heads x dim {tuple(k.shape[1:])} do not match the cache ({hkv}, {d})"
        )
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("write_kv_cache needs unit stride along head_dim")
    kc, vc = kv_cache[0], kv_cache[1]
    block_d = next_pow2(d)
    block_h = min(next_pow2(hkv), max(1, 2048 // block_d))
    grid = (n, triton.cdiv(hkv, block_h))
    _kv_cache_write_kernel[grid](
        k,
        v,
        kc,
        vc,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        vc.stride(0),
        vc.stride(1),
        vc.stride(2),
        hkv,
        float(k_scale),
        float(v_scale),
        HEAD_D=d,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        PAGE=page,
        FP8_MAX=FP8_MAX if kv_cache.dtype == FP8_DTYPE else 0.0,
        ROUND_FIRST=interpret_mode(),
        num_warps=4 if block_h * block_d >= 1024 else 2,
        **pdl_args(k.device),
    )


def write_kv_cache_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain-torch reference of :func:`write_kv_cache` (negative slots skipped)."""
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    write_kv_reference(k[:n][keep], v[:n][keep], kv_cache, slot_mapping[keep], k_scale, v_scale)


# ---------------------------------------------------------------- RoPE + K/V write
@triton.jit
def _to_cache(x, scale, FP8_MAX: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """A tile as an fp8 cache stores it (``x / scale`` saturated; ``FP8_MAX`` 0: as is)."""
    if FP8_MAX > 0:
        x = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
        if ROUND_FIRST:
            x = round_to_e4m3(x)
    return x


@triton.jit
def _rope_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    stride_qt,
    stride_kt,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_kv_heads,
    n_write,
    k_scale,
    v_scale,
    HEAD_D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr,
    ROUND: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    c, s = load_cos_sin(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, offs, HALF)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_off = heads.to(tl.int64) * HEAD_D
    # q: rotated in place (each element read and written by the same thread)
    q_ok = (heads < num_q_heads)[:, None] & (offs[None, :] < HALF)
    qb = q_ptr + t * stride_qt + head_off[:, None]
    x1, x2 = load_pairs(qb, offs, q_ok, HALF, False)
    y1, y2 = rotate_pairs(x1, x2, c, s, ROUND)
    tl.store(qb + offs[None, :], y1, mask=q_ok)
    tl.store(qb + HALF + offs[None, :], y2, mask=q_ok)
    # k: rotated in place (the SDPA prefill path reads this step's K) and written
    kv_h = heads < num_kv_heads
    k_ok = kv_h[:, None] & (offs[None, :] < HALF)
    kb = k_ptr + t * stride_kt + head_off[:, None]
    x1, x2 = load_pairs(kb, offs, k_ok, HALF, False)
    y1, y2 = rotate_pairs(x1, x2, c, s, ROUND)
    tl.store(kb + offs[None, :], y1, mask=k_ok)
    tl.store(kb + HALF + offs[None, :], y2, mask=k_ok)
    if t < n_write:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // PAGE
            off = slot % PAGE
            dst = kc_ptr + blk * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch
            tl.store(dst + offs[None, :], _to_cache(y1, k_scale, FP8_MAX, ROUND_FIRST)
                     .to(kc_ptr.dtype.element_ty), mask=k_ok)  # fmt: skip
            tl.store(dst + HALF + offs[None, :], _to_cache(y2, k_scale, FP8_MAX, ROUND_FIRST)
                     .to(kc_ptr.dtype.element_ty), mask=k_ok)  # fmt: skip
            d = tl.arange(0, BLOCK_D)
            if 2 * HALF < HEAD_D:  # partial rotary: the dims past it as they are
                tail = kv_h[:, None] & (d[None, :] >= 2 * HALF) & (d[None, :] < HEAD_D)
                x = tl.load(kb + d[None, :], mask=tail)
                x = _to_cache(x, k_scale, FP8_MAX, ROUND_FIRST)
                tl.store(dst + d[None, :], x.to(kc_ptr.dtype.element_ty), mask=tail)
            v_ok = kv_h[:, None] & (d[None, :] < HEAD_D)
            v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=v_ok)
            v = _to_cache(v, v_scale, FP8_MAX, ROUND_FIRST)
            dst = vc_ptr + blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch
            tl.store(dst + d[None, :], v.to(vc_ptr.dtype.element_ty), mask=v_ok)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """One launch for :func:`~pdserve.kernels.rope.apply_rope` (neox) on ``q`` [T, H, D]
    and ``k`` [T, Hkv, D], both IN PLACE, and :func:`write_kv_cache` of the rotated ``k``
    and ``v`` [T, Hkv, D] for the first ``slot_mapping.shape[0]`` tokens (negative slots
    skipped). Heads must be contiguous (unit inner stride, head stride ``D``) in ``q``
    and ``k``; rows may be strided (views of a fused qkv projection)."""
    check_device(kv_cache, "rope_write_kv")
    t, hq, d = q.shape
    _, _, page, hkv, dc = kv_cache.shape
    half = cos_cache.shape[-1]
    if k.shape != (t, hkv, d) or v.shape != (t, hkv, d) or dc != d:
        raise ValueError(f"q/k/v {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} do not "
                         f"fit the cache ({hkv}, {dc})")  # fmt: skip
    for x, what in ((q, "q"), (k, "k")):
        if x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError(f"rope_write_kv: {what} needs contiguous heads of size {d}")
    if v.stride(2) != 1 or kv_cache.stride(-1) != 1 or cos_cache.stride(-1) != 1:
        raise ValueError("rope_write_kv needs unit stride along head_dim")
    if 2 * half > d or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin tables {tuple(cos_cache.shape)} do not fit head_dim {d}")
    n = slot_mapping.shape[0]
    if n > t:
        raise ValueError(f"slot_mapping has {n} tokens but q/k/v have {t}")
    if t == 0:
        return
    kc, vc = kv_cache[0], kv_cache[1]
    block_half = next_pow2(half)
    block_h = min(next_pow2(max(hq, hkv)), max(1, 4096 // next_pow2(d)))
    _rope_kv_write_kernel[(t, triton.cdiv(max(hq, hkv), block_h))](
        q, k, v, kc, vc, positions, cos_cache, sin_cache, slot_mapping,
        q.stride(0), k.stride(0), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        cos_cache.stride(0), sin_cache.stride(0), hq, hkv, n, float(k_scale), float(v_scale),
        HEAD_D=d, HALF=half, BLOCK_HALF=block_half, BLOCK_D=next_pow2(d), BLOCK_H=block_h,
        PAGE=page, ROUND=q.dtype != torch.float32,
        FP8_MAX=FP8_MAX if kv_cache.dtype == FP8_DTYPE else 0.0, ROUND_FIRST=interpret_mode(),
        num_warps=4, enable_fp_fusion=False,  # an FMA would skip the product's rounding
        **pdl_args(q.device),
    )  # fmt: skip


def rope_write_kv_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`rope_write_kv` does, with the unfused model's ops: (rotated q, rotated
    k), out of place, and the cache written by :func:`write_kv_cache_reference`."""
    from pdserve.kernels.rope import apply_rope_reference

    q2, k2 = apply_rope_reference(q, k, positions, cos_cache, sin_cache, q.shape[-1])
    write_kv_cache_reference(k2, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q2, k2
