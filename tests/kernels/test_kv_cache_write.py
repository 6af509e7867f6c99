"""Parity of the paged K/V scatter with the reference ``index_copy_``."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference


@pytest.mark.parametrize(
    "hkv,d,bs,dtype",
    [
        (1, 16, 16, torch.float32),
        (4, 64, 32, torch.bfloat16),
        (8, 128, 64, torch.float16),
        (3, 80, 16, torch.float32),
    ],
)
def test_write_matches_reference(
    device: torch.device, hkv: int, d: int, bs: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    num_blocks, t = 6, 19
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(dtype).to(device)
    slots = torch.randperm((num_blocks - 1) * bs, generator=g)[:t] + bs  # never the null block
    slots = slots.to(device)
    # k/v as views of a wider fused projection (row stride > Hkv*D), plus 2 padded rows
    kv = torch.randn(t + 2, 3, hkv, d, generator=g).to(dtype).to(device)
    k, v = kv[:, 0], kv[:, 2]
    got, ref = cache.clone(), cache.clone()
    write_kv_cache(k, v, got, slots)
    write_kv_cache_reference(k, v, ref, slots)
    assert torch.equal(got, ref)


def test_negative_slots_are_skipped(device: torch.device) -> None:
    cache = torch.zeros(2, 3, 4, 2, 16, device=device)
    k = torch.ones(3, 2, 16, device=device)
    slots = torch.tensor([5, -1, 0], dtype=torch.int64, device=device)
    write_kv_cache(k, 2 * k, cache, slots)
    flat_k, flat_v = cache[0].reshape(-1, 2, 16), cache[1].reshape(-1, 2, 16)
    assert torch.all(flat_k[[0, 5]] == 1) and torch.all(flat_v[[0, 5]] == 2)
    assert flat_k.sum() == 2 * 2 * 16  # nothing else written


@pytest.mark.parametrize(
    "h,hkv,d,rot,dtype,fp8",
    [
        (4, 2, 16, 16, torch.float32, False),
        (8, 2, 64, 64, torch.bfloat16, False),
        (6, 2, 32, 16, torch.float32, False),  # partial rotary: dims past 16 copied as they are
        (4, 2, 32, 32, torch.bfloat16, True),  # an fp8 cache with static scales
    ],
)
def test_rope_write_kv_matches_rope_then_write(
    device: torch.device, h: int, hkv: int, d: int, rot: int, dtype: torch.dtype, fp8: bool
) -> None:
    from pdserve.kernels.kv_cache_write import rope_write_kv, rope_write_kv_reference
    from pdserve.kernels.reference import FP8_DTYPE
    from pdserve.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(d + h)
    t, n, bs, blocks = 7, 5, 4, 6  # 2 graph-padding rows past the slots
    rope = RotaryEmbedding(rot, 256, 10000.0, dtype=dtype).to(device)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype).to(device)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
    pos = torch.randint(0, 256, (t,), generator=g).to(device)
    slots = (torch.randperm((blocks - 1) * bs, generator=g)[:n] + bs).to(device)
    slots[1] = -1  # skipped
    cache_dtype = FP8_DTYPE if fp8 else dtype
    ref_cache = torch.zeros(2, blocks, bs, hkv, d, dtype=cache_dtype, device=device)
    got_cache = ref_cache.clone()
    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    ref_q, ref_k = rope_write_kv_reference(
        q, k, v, pos, rope.cos_cache, rope.sin_cache, ref_cache, slots, *scales
    )
    rope_write_kv(q, k, v, pos, rope.cos_cache, rope.sin_cache, got_cache, slots, *scales)
    # the interpreter truncates fp32 -> bf16 casts: a couple of ulps on the CPU
    exact = dtype == torch.float32 or device.type == "cuda"
    kw = {"atol": 0.0, "rtol": 0.0} if exact else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(q, ref_q, **kw)  # rotated in place
    torch.testing.assert_close(k, ref_k, **kw)
    if fp8 and not exact:  # a bf16 ulp may cross an fp8 rounding boundary: one fp8 step
        kw = {"atol": 1e-2, "rtol": 0.13}
    torch.testing.assert_close(got_cache.float(), ref_cache.float(), **kw)
    assert got_cache.float().abs().sum() > 0
