"""Parity of the fused MLA and DSA-indexer preparation kernels (RoPE, norms, the paged
cache writes, the weights' scaling) with the unfused model's torch ops."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.index_cache import (
    dequantize_index_cache,
    fp8_index_row_bytes,
    indexer_cache_views,
)
from pdserve.kernels.mla_prep import (
    indexer_prepare,
    indexer_prepare_reference,
    mla_prepare,
    mla_prepare_reference,
)
from pdserve.kernels.reference import FP8_DTYPE
from pdserve.layers.rotary import RotaryEmbedding

T, N, PAGE, BLOCKS = 6, 4, 4, 5  # 2 graph-padding rows past the written ones


def _kw(dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    # the interpreter truncates fp32 -> bf16 casts: a couple of ulps on the CPU
    exact = dtype == torch.float32 or device.type == "cuda"
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 0.0, "rtol": 0.0} if exact else {"atol": 2e-2, "rtol": 2e-2}


def _slots(g: torch.Generator, device: torch.device) -> torch.Tensor:
    slots = torch.randperm((BLOCKS - 1) * PAGE, generator=g)[:N] + PAGE
    slots[2] = -1  # skipped
    return slots.to(device)


@pytest.mark.parametrize(
    "heads,lat,rope,dtype,interleaved,fp8",
    [
        (4, 64, 16, torch.float32, True, False),
        (20, 48, 8, torch.bfloat16, True, False),  # heads past one head block
        (3, 32, 16, torch.float32, False, False),  # half-split layout
        (4, 64, 16, torch.bfloat16, True, True),  # an fp8 latent cache with its scale
    ],
)
def test_mla_prepare_matches_reference(
    device: torch.device,
    heads: int,
    lat: int,
    rope: int,
    dtype: torch.dtype,
    interleaved: bool,
    fp8: bool,
) -> None:
    g = torch.Generator().manual_seed(heads + lat)
    rot = RotaryEmbedding(rope, 128, 10000.0, dtype=dtype).to(device)
    nope = 8
    q = torch.randn(T, heads, nope + rope, generator=g).to(dtype).to(device)
    q_pe = q[..., nope:]  # a strided view, as the model has it
    kv = (3 * torch.randn(T, lat + rope, generator=g)).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(lat, generator=g)).to(dtype).to(device)
    pos = torch.randint(0, 128, (T,), generator=g).to(device)
    slots = _slots(g, device)
    caches = [
        torch.zeros(BLOCKS, PAGE, lat + rope, dtype=FP8_DTYPE if fp8 else dtype, device=device)
        for _ in range(2)
    ]
    scale = 0.5 if fp8 else 1.0
    args = (1e-6, pos, rot.cos_cache, rot.sin_cache, interleaved)
    ref = mla_prepare_reference(q_pe, kv, w, *args, caches[0], slots, scale)
    got = mla_prepare(q_pe, kv, w, *args, caches[1], slots, scale)
    assert got.is_contiguous()
    kw = _kw(dtype, device)
    torch.testing.assert_close(got, ref, **kw)
    if fp8 and kw["rtol"] > 0:  # a bf16 ulp may cross an fp8 rounding boundary: one step
        kw = {"atol": 1e-2, "rtol": 0.13}
    torch.testing.assert_close(caches[1].float(), caches[0].float(), **kw)
    assert (caches[1].float() != 0).sum() == (N - 1) * (lat + rope)  # skipped slot unwritten


@pytest.mark.parametrize(
    "nh,d,rope,dtype,interleaved",
    [
        (16, 32, 16, torch.float32, True),
        (8, 64, 16, torch.bfloat16, True),
        (5, 32, 8, torch.float32, False),  # DeepSeek-V3.2's half-split indexer RoPE
    ],
)
def test_indexer_prepare_matches_reference(
    device: torch.device, nh: int, d: int, rope: int, dtype: torch.dtype, interleaved: bool
) -> None:
    g = torch.Generator().manual_seed(nh + d)
    rot = RotaryEmbedding(rope, 128, 10000.0, dtype=dtype).to(device)
    q = torch.randn(T, nh * d, generator=g).to(dtype).to(device).view(T, nh, d)
    xk = torch.randn(T, d + nh, generator=g).to(dtype).to(device)
    k, w = xk[:, :d], xk[:, d:]  # strided rows
    ln_w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(device)
    ln_b = (0.1 * torch.randn(d, generator=g)).to(dtype).to(device)
    pos = torch.randint(0, 128, (T,), generator=g).to(device)
    slots = _slots(g, device)
    caches = [torch.zeros(BLOCKS, PAGE, d, dtype=dtype, device=device) for _ in range(2)]
    args = (ln_w, ln_b, 1e-6, pos, rot.cos_cache, rot.sin_cache, interleaved)
    ref_q, ref_w = indexer_prepare_reference(q, k, w, *args, caches[0], slots)
    got_q, got_w = indexer_prepare(q, k, w, *args, caches[1], slots)
    assert got_q.is_contiguous() and got_w.dtype == torch.float32
    kw = _kw(dtype, device)
    torch.testing.assert_close(got_q, ref_q, **kw)
    torch.testing.assert_close(got_w, ref_w, atol=0.0, rtol=0.0)
    # LayerNorm's float32 statistics may differ from torch's in the last bits
    kw = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(caches[1], caches[0], **kw)
    assert (caches[1] != 0).any(dim=-1).sum() == N - 1


@pytest.mark.parametrize(
    "nh,d,rope,dtype,interleaved",
    [
        (8, 32, 16, torch.bfloat16, True),  # GLM-5's layout
        (5, 48, 8, torch.float32, False),  # half-split RoPE, a tail past it
    ],
)
def test_indexer_prepare_writes_fp8_keys_with_their_scales(
    device: torch.device, nh: int, d: int, rope: int, dtype: torch.dtype, interleaved: bool
) -> None:
    """An fp8 indexer cache: each written key quantized with its own float32 scale
    (amax / 448) beside it. The kernel's scales equal the reference's within LayerNorm's
    last-bit differences, its fp8 values within one e4m3 step of them (a rounding can
    fall the other way); q and the weights as in the model-dtype case."""
    g = torch.Generator().manual_seed(nh + d + 1)
    rot = RotaryEmbedding(rope, 128, 10000.0, dtype=dtype).to(device)
    q = torch.randn(T, nh, d, generator=g).to(dtype).to(device)
    k = (3 * torch.randn(T, d, generator=g)).to(dtype).to(device)
    w = torch.randn(T, nh, generator=g).to(dtype).to(device)
    ln_w = (1 + 0.5 * torch.randn(d, generator=g)).to(dtype).to(device)
    ln_b = (0.1 * torch.randn(d, generator=g)).to(dtype).to(device)
    pos = torch.randint(0, 128, (T,), generator=g).to(device)
    slots = _slots(g, device)
    raws = [torch.zeros(BLOCKS, PAGE * fp8_index_row_bytes(d), dtype=torch.uint8,
                        device=device) for _ in range(2)]  # fmt: skip
    args = (ln_w, ln_b, 1e-6, pos, rot.cos_cache, rot.sin_cache, interleaved)
    outs = []
    for fn, raw in zip((indexer_prepare_reference, indexer_prepare), raws, strict=True):
        keys, scales = indexer_cache_views(raw, d)
        outs.append(fn(q, k, w, *args, keys, slots, scales))
    torch.testing.assert_close(outs[1][0], outs[0][0], **_kw(dtype, device))
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=0.0, rtol=0.0)
    (ref_k, ref_s), (got_k, got_s) = (indexer_cache_views(r, d) for r in raws)
    assert ref_s is not None and got_s is not None
    written = (ref_s > 0).sum()
    assert written == (got_s > 0).sum() == N - 1 and bool(((ref_s > 0) == (got_s > 0)).all())
    torch.testing.assert_close(
        got_s, ref_s, atol=0.0, rtol=2e-2 if dtype != torch.float32 else 1e-5
    )
    ref_deq, got_deq = (dequantize_index_cache(r, d) for r in raws)
    step = ref_deq.abs() * 2**-3 + ref_s[..., None] * 2**-9  # one e4m3 step
    assert bool(((got_deq - ref_deq).abs() <= step + 1e-6).all())
    same = (got_k.view(torch.uint8) == ref_k.view(torch.uint8)).float().mean()
    assert float(same) > 0.95  # most values round identically
