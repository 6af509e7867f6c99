"""The small per-token work before MLA attention and the DSA indexer, one launch each.

Unfused, a GLM-5 / DeepSeek-V3.2 layer runs about 25 small torch ops between its
projections and its attention kernels (two RoPE gathers, the rotation's products and
``cat``s, a norm, the cache writes, a dtype cast); at decode batch sizes every one of
them is a kernel launch of a few hundred bytes. Here:

:func:`mla_prepare` (program per token and head block): rotate ``q_pe`` [T, H, R] (a
    strided view of ``q_b_proj``'s output) into a contiguous buffer; in head block 0,
    RMS-normalise the latent ``kv[:, :L]`` and rotate ``k_pe = kv[:, L:]``, and write
    ``[latent | k_pe]`` into the token's paged cache row (``/ kv_scale`` and saturated
    for an fp8 cache). What :func:`mla_prepare_reference` does with the model's ops.
:func:`indexer_prepare` (program per token): rotate the first ``R`` dims of every index
    head of ``q`` [T, NH, D] into a contiguous buffer; ``weights * NH**-0.5`` in float32;
    ``LayerNorm`` the key ``k`` [T, D], rotate its first ``R`` dims and write it into
    the indexer cache (an fp8 indexer cache: quantized with one float32 scale a key,
    ``amax / 448``, stored beside it; :mod:`pdserve.kernels.index_cache`).
    :func:`indexer_prepare_reference` is the unfused model.

RoPE either layout (:func:`~pdserve.kernels.rope.load_pairs`), cos/sin gathered from
the tables by position in the kernel (no per-layer gather), each product rounded to the
model dtype as torch rounds it (bit-equal on the compiled path for bf16; no FMA). Norm
statistics in float32 (RMSNorm's value rounded to the model dtype before its weight
multiply, as :mod:`pdserve.layers.norm`; LayerNorm as torch's ``layer_norm``: one
rounding at the end). Only the first ``slot_mapping.shape[0]`` tokens are written;
negative slots are skipped. No host sync; the grid depends on shapes only.
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
from pdserve.kernels.index_cache import check_key_cache, write_index_keys
from pdserve.kernels.kv_cache_write import _to_cache
from pdserve.kernels.reference import (
    FP8_DTYPE,
    FP8_MAX,
    apply_rotary,
    apply_rotary_interleaved,
    rms_norm,
    write_paged,
)
from pdserve.kernels.rope import load_cos_sin, load_pairs, rotate_pairs


@triton.jit
def _mla_prep_kernel(
    q_ptr,
    kv_ptr,
    w_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    cache_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_cos,
    stride_sin,
    stride_cb,
    stride_cs,
    stride_ot,
    stride_oh,
    num_heads,
    n_write,
    eps,
    kv_scale,
    LAT: tl.constexpr,
    BLOCK_L: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
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
    ok = (heads < num_heads)[:, None] & (offs[None, :] < HALF)
    x1, x2 = load_pairs(q_ptr + t * stride_qt + heads[:, None] * stride_qh, offs, ok, HALF,
                        INTERLEAVED)  # fmt: skip
    y1, y2 = rotate_pairs(x1, x2, c, s, ROUND)
    ob = out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs[None, :]
    tl.store(ob, y1, mask=ok)
    tl.store(ob + HALF, y2, mask=ok)
    if (hb == 0) & (t < n_write):
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
            row = kv_ptr + t * stride_kvt
            cols = tl.arange(0, BLOCK_L)
            lm = cols < LAT
            x = tl.load(row + cols, mask=lm, other=0.0)
            dt = x.dtype
            xf = x.to(tl.float32)
            var = tl.sum(xf * xf, axis=0) / LAT
            xn = (xf * tl.rsqrt(var + eps)).to(dt).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=lm, other=0.0).to(tl.float32)
            lat = _to_cache((xn * w).to(dt), kv_scale, FP8_MAX, ROUND_FIRST)
            tl.store(dst + cols, lat.to(cache_ptr.dtype.element_ty), mask=lm)
            km = (offs < HALF)[None, :]
            k1, k2 = load_pairs(row + LAT, offs, km, HALF, INTERLEAVED)
            r1, r2 = rotate_pairs(k1, k2, c, s, ROUND)
            r1 = _to_cache(r1, kv_scale, FP8_MAX, ROUND_FIRST)
            r2 = _to_cache(r2, kv_scale, FP8_MAX, ROUND_FIRST)
            kd = dst + LAT + offs[None, :]
            tl.store(kd, r1.to(cache_ptr.dtype.element_ty), mask=km)
            tl.store(kd + HALF, r2.to(cache_ptr.dtype.element_ty), mask=km)


def mla_prepare(
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    interleaved: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """The rotated ``q_pe`` [T, H, R] (contiguous); writes ``[rmsnorm(kv[:, :L]) |
    rope(kv[:, L:])]`` of the first ``slot_mapping.shape[0]`` tokens into ``cache``
    [blocks, block_size, L + R]."""
    check_device(cache, "mla_prepare")
    t, heads, r = q_pe.shape
    lat = norm_weight.shape[0]
    half = cos_cache.shape[-1]
    if kv.shape != (t, lat + r) or cache.shape[-1] != lat + r or 2 * half != r:
        raise ValueError(f"mla_prepare: kv {tuple(kv.shape)}, cache width {cache.shape[-1]}, "
                         f"latent {lat}, rope {r} (tables of {half} pairs) do not fit")  # fmt: skip
    if q_pe.stride(2) != 1 or kv.stride(1) != 1 or cache.stride(-1) != 1:
        raise ValueError("mla_prepare needs unit stride along the last dimension")
    n = slot_mapping.shape[0]
    if n > t:
        raise ValueError(f"slot_mapping has {n} tokens but q_pe has {t}")
    out = torch.empty(t, heads, r, dtype=q_pe.dtype, device=q_pe.device)
    if t == 0:
        return out
    block_half = next_pow2(half)
    block_h = min(next_pow2(heads), max(1, 2048 // block_half))
    _mla_prep_kernel[(t, triton.cdiv(heads, block_h))](
        q_pe, kv, norm_weight, positions, cos_cache, sin_cache, slot_mapping, cache, out,
        q_pe.stride(0), q_pe.stride(1), kv.stride(0), cos_cache.stride(0), sin_cache.stride(0),
        cache.stride(0), cache.stride(1), out.stride(0), out.stride(1), heads, n, eps,
        float(kv_scale), LAT=lat, BLOCK_L=next_pow2(lat), HALF=half, BLOCK_HALF=block_half,
        BLOCK_H=block_h, PAGE=cache.shape[1], INTERLEAVED=interleaved,
        ROUND=q_pe.dtype != torch.float32,
        FP8_MAX=FP8_MAX if cache.dtype == FP8_DTYPE else 0.0, ROUND_FIRST=interpret_mode(),
        num_warps=4, enable_fp_fusion=False,  # an FMA would skip the products' rounding
        **pdl_args(q_pe.device),
    )  # fmt: skip
    return out


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    return (apply_rotary_interleaved if interleaved else apply_rotary)(x, cos, sin)


def mla_prepare_reference(
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    interleaved: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """The unfused model's ops for :func:`mla_prepare` (negative slots skipped)."""
    cos, sin = cos_cache[positions], sin_cache[positions]
    lat = norm_weight.shape[0]
    latent = rms_norm(kv[:, :lat], norm_weight, eps)
    k_pe = _rotate(kv[:, None, lat:], cos, sin, interleaved)[:, 0]
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    entry = torch.cat([latent[:n], k_pe[:n]], dim=-1)[keep]
    write_paged(cache.view(-1, cache.shape[-1]), slot_mapping[keep], entry, kv_scale)
    return _rotate(q_pe, cos, sin, interleaved)


@triton.jit
def _indexer_prep_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    lnw_ptr,
    lnb_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    cache_ptr,
    ks_ptr,
    q_out_ptr,
    w_out_ptr,
    stride_qt,
    stride_kt,
    stride_wt,
    stride_cos,
    stride_sin,
    stride_cb,
    stride_cs,
    stride_kb,
    stride_qot,
    n_heads,
    n_write,
    eps,
    w_scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_NH: tl.constexpr,
    PAGE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROUND: tl.constexpr,
    KEY_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    p_ok = offs < HALF
    c, s = load_cos_sin(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, offs, HALF)
    heads = tl.arange(0, BLOCK_NH)
    h_ok = heads < n_heads
    d = tl.arange(0, BLOCK_D)
    # q: the rope dims rotated, the rest copied, into a contiguous [NH, D] row
    qb = q_ptr + t * stride_qt + heads[:, None] * D
    ok = h_ok[:, None] & p_ok[None, :]
    x1, x2 = load_pairs(qb, offs, ok, HALF, INTERLEAVED)
    y1, y2 = rotate_pairs(x1, x2, c, s, ROUND)
    ob = q_out_ptr + t * stride_qot + heads[:, None] * D
    tl.store(ob + offs[None, :], y1, mask=ok)
    tl.store(ob + HALF + offs[None, :], y2, mask=ok)
    rest = h_ok[:, None] & (d[None, :] >= 2 * HALF) & (d[None, :] < D)
    tl.store(ob + d[None, :], tl.load(qb + d[None, :], mask=rest), mask=rest)
    # the head weights, float32 and scaled
    w = tl.load(w_ptr + t * stride_wt + heads, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(w_out_ptr + t * n_heads + heads, w * w_scale, mask=h_ok)
    # k: LayerNorm, the rope dims rotated, into the cache
    if t < n_write:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            row = k_ptr + t * stride_kt
            dm = d < D
            x = tl.load(row + d, mask=dm, other=0.0)
            dt = x.dtype
            xf = x.to(tl.float32)
            mean = tl.sum(xf, axis=0) / D
            xc = tl.where(dm, xf - mean, 0.0)
            rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / D + eps)
            if INTERLEAVED:
                i1 = 2 * offs
                i2 = i1 + 1
            else:
                i1 = offs
                i2 = offs + HALF
            k1 = _layer_norm_at(row, lnw_ptr, lnb_ptr, i1, p_ok, mean, rstd, dt)
            k2 = _layer_norm_at(row, lnw_ptr, lnb_ptr, i2, p_ok, mean, rstd, dt)
            r1, r2 = rotate_pairs(k1[None, :], k2[None, :], c, s, ROUND)
            tail = dm & (d >= 2 * HALF)
            kt = _layer_norm_at(row, lnw_ptr, lnb_ptr, d, tail, mean, rstd, dt)
            dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
            if KEY_FP8:  # one scale for the whole key (its rounded model-dtype values)
                r1 = r1.to(tl.float32)
                r2 = r2.to(tl.float32)
                kt = tl.where(tail, kt.to(tl.float32), 0.0)
                amax = tl.maximum(tl.max(tl.max(tl.abs(r1), axis=1), axis=0),
                                  tl.max(tl.max(tl.abs(r2), axis=1), axis=0))  # fmt: skip
                amax = tl.maximum(amax, tl.max(tl.abs(kt), axis=0))
                ksc = tl.maximum(amax / FP8_MAX, 1e-12)
                r1 = tl.clamp(r1 / ksc, -FP8_MAX, FP8_MAX)
                r2 = tl.clamp(r2 / ksc, -FP8_MAX, FP8_MAX)
                kt = tl.clamp(kt / ksc, -FP8_MAX, FP8_MAX)
                if ROUND_FIRST:  # the interpreter's fp8 cast (see round_to_e4m3)
                    r1 = round_to_e4m3(r1)
                    r2 = round_to_e4m3(r2)
                    kt = round_to_e4m3(kt)
                tl.store(ks_ptr + (slot // PAGE) * stride_kb + slot % PAGE, ksc)
            ety = cache_ptr.dtype.element_ty
            tl.store(dst + offs[None, :], r1.to(ety), mask=p_ok[None, :])
            tl.store(dst + HALF + offs[None, :], r2.to(ety), mask=p_ok[None, :])
            tl.store(dst + d, kt.to(ety), mask=tail)


@triton.jit
def _layer_norm_at(row, w_ptr, b_ptr, idx, mask, mean, rstd, dt: tl.constexpr):
    """LayerNorm of ``row[idx]`` given its statistics, rounded once to ``dt``."""
    x = tl.load(row + idx, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    return ((x - mean) * rstd * w + b).to(dt)


def indexer_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    interleaved: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q with its first ``R = 2 * pairs`` dims rotated [T, NH, D] contiguous, ``weights``
    [T, NH] as float32 times ``NH**-0.5``); writes ``rope(layer_norm(k))`` of the first
    ``slot_mapping.shape[0]`` tokens into ``cache`` [blocks, block_size, D]; with
    ``k_scale`` [blocks, block_size] float32, ``cache`` holds fp8 keys and each key is
    written quantized with its own scale (the views of
    :func:`~pdserve.kernels.index_cache.indexer_cache_views`)."""
    check_device(cache, "indexer_prepare")
    t, nh, d = q.shape
    half = cos_cache.shape[-1]
    check_key_cache(cache, k_scale, d)
    if k.shape != (t, d) or weights.shape != (t, nh) or 2 * half > d:
        raise ValueError(f"indexer_prepare: q {tuple(q.shape)}, k {tuple(k.shape)}, weights "
                         f"{tuple(weights.shape)}, cache width {cache.shape[-1]}, "
                         f"{half} rope pairs do not fit")  # fmt: skip
    if q.stride(2) != 1 or q.stride(1) != d or k.stride(1) != 1 or weights.stride(1) != 1:
        raise ValueError("indexer_prepare needs contiguous heads and unit inner strides")
    n = slot_mapping.shape[0]
    if n > t:
        raise ValueError(f"slot_mapping has {n} tokens but q has {t}")
    q_out = torch.empty(t, nh, d, dtype=q.dtype, device=q.device)
    w_out = torch.empty(t, nh, dtype=torch.float32, device=q.device)
    if t == 0:
        return q_out, w_out
    _indexer_prep_kernel[(t,)](
        q, k, weights, ln_weight, ln_bias, positions, cos_cache, sin_cache, slot_mapping, cache,
        cache if k_scale is None else k_scale, q_out, w_out, q.stride(0), k.stride(0),
        weights.stride(0), cos_cache.stride(0), sin_cache.stride(0), cache.stride(0),
        cache.stride(1), 0 if k_scale is None else k_scale.stride(0), q_out.stride(0), nh, n,
        eps, nh**-0.5, D=d, BLOCK_D=next_pow2(d), HALF=half, BLOCK_HALF=next_pow2(half),
        BLOCK_NH=next_pow2(nh), PAGE=cache.shape[1], INTERLEAVED=interleaved,
        ROUND=q.dtype != torch.float32, KEY_FP8=k_scale is not None, FP8_MAX=FP8_MAX,
        ROUND_FIRST=interpret_mode(), num_warps=4, enable_fp_fusion=False,
        **pdl_args(q.device),
    )  # fmt: skip
    return q_out, w_out


def indexer_prepare_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    interleaved: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused :class:`~pdserve.layers.attention.dsa.Indexer` ops for
    :func:`indexer_prepare` (negative slots skipped; ``k_scale``: an fp8 key cache)."""
    cos, sin = cos_cache[positions], sin_cache[positions]
    r = 2 * cos.shape[-1]
    k = torch.nn.functional.layer_norm(k, (k.shape[-1],), ln_weight, ln_bias, eps)
    q = torch.cat([_rotate(q[..., :r], cos, sin, interleaved), q[..., r:]], dim=-1)
    k = torch.cat([_rotate(k[:, None, :r], cos, sin, interleaved)[:, 0], k[:, r:]], dim=-1)
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    write_index_keys(cache, k_scale, slot_mapping[keep], k[:n][keep])
    return q, weights.float() * q.shape[1] ** -0.5
