"""Parity of the in-place Triton RoPE with the model's apply_rotary."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.rope import apply_rope, apply_rope_reference
from pdserve.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize(
    "h,hkv,d,rot,dtype",
    [
        (4, 4, 16, 16, torch.float32),
        (8, 2, 64, 64, torch.bfloat16),
        (32, 8, 128, 128, torch.float16),
        (6, 2, 32, 16, torch.float32),  # partial rotary: last 16 dims untouched
    ],
)
def test_rope_matches_reference(
    device: torch.device, h: int, hkv: int, d: int, rot: int, dtype: torch.dtype
) -> None:
    t = 11
    rope = RotaryEmbedding(rot, 512, 10000.0, dtype=dtype).to(device)
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype).to(device)
    q, k = qkv[:, : h * d], qkv[:, h * d : (h + hkv) * d]  # row-strided views
    positions = torch.randint(0, 512, (t,), generator=g).to(device)
    ref_q, ref_k = apply_rope_reference(q, k, positions, rope.cos_cache, rope.sin_cache, d)
    v_before = qkv[:, (h + hkv) * d :].clone()
    out_q, out_k = apply_rope(q, k, positions, rope.cos_cache, rope.sin_cache, d)
    assert out_q.data_ptr() == q.data_ptr()
    exact = dtype != torch.float32 and device.type == "cuda"
    # the CPU interpreter truncates fp32 -> bf16 casts, so allow a couple of ulps there
    kw = {"atol": 0.0, "rtol": 0.0} if exact else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(q, ref_q, **kw)
    torch.testing.assert_close(k, ref_k, **kw)
    assert torch.equal(qkv[:, (h + hkv) * d :], v_before)  # v untouched


def test_rope_3d_input(device: torch.device) -> None:
    rope = RotaryEmbedding(16, 64, 10000.0).to(device)
    q = torch.randn(5, 4, 16, device=device)
    k = torch.randn(5, 2, 16, device=device)
    pos = torch.arange(5, device=device)
    ref_q, ref_k = apply_rope_reference(q, k, pos, rope.cos_cache, rope.sin_cache, 16)
    apply_rope(q, k, pos, rope.cos_cache, rope.sin_cache, 16)
    torch.testing.assert_close(q, ref_q)
    torch.testing.assert_close(k, ref_k)
