"""Scatter this step's K and V into the paged KV cache.

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

from pdserve.kernels._utils import check_device, interpret_mode, next_pow2, round_to_e4m3
from pdserve.kernels.reference import FP8_DTYPE, FP8_MAX, write_kv_reference


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
):
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
