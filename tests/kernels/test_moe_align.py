"""Parity of the one-launch MoE token alignment with the torch ops it replaces (exact),
and of the one-launch combine (the k rows' float32 sum, plus the shared experts) with the
unfused sum, copy and add."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fused_moe import align_by_expert, align_pairs
from pdserve.kernels.moe_align import (
    MAX_ALIGN_PAIRS,
    align_fits,
    moe_align,
    moe_combine,
    moe_combine_reference,
)


@pytest.mark.parametrize(
    "t,e,k,bm",
    [
        (1, 8, 2, 16),  # one decode token
        (1, 256, 8, 16),  # GLM-5's routing at batch 1
        (13, 8, 3, 4),  # a crowded expert and empty ones
        (32, 64, 8, 16),  # 256 pairs
        (128, 200, 8, 64),  # the most one program takes: 1024 pairs
    ],
)
def test_moe_align_matches_align_by_expert(
    device: torch.device, t: int, e: int, k: int, bm: int
) -> None:
    g = torch.Generator().manual_seed(t * e + k)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t > 2:
        ids[: t // 2, 0] = e - 1  # crowd the last expert
    ids = ids.to(device)
    assert align_fits(t * k, e)
    got = moe_align(ids, e, bm)
    ref = align_by_expert(ids, e, bm)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype == torch.int32
        assert torch.equal(a, b)


def test_align_pairs_falls_back_past_one_program(device: torch.device) -> None:
    t, k = MAX_ALIGN_PAIRS // 4 + 1, 4
    ids = (torch.arange(t * k) % 7).view(t, k).to(device)
    assert not align_fits(t * k, 7)
    for a, b in zip(align_pairs(ids, 7, 16), align_by_expert(ids, 7, 16), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_add", [False, True])
def test_moe_combine_matches_sum_copy_add(
    device: torch.device, dtype: torch.dtype, with_add: bool
) -> None:
    g = torch.Generator().manual_seed(3)
    t, k, h = 5, 8, 1500  # hidden past one column block
    rows = torch.randn(t * k, h, generator=g).to(dtype).to(device)
    add = torch.randn(t, h, generator=g).to(dtype).to(device) if with_add else None
    got = moe_combine(rows, k, torch.empty(t, h, dtype=dtype, device=device), add)
    ref = moe_combine_reference(rows, k, torch.empty(t, h, dtype=dtype, device=device), add)
    if dtype == torch.float32:  # float32 sums in another order
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        return
    # bf16: each rounding (of the sum, then of sum + add) may differ by an ulp (the CPU
    # interpreter truncates instead of rounding to nearest): two ulps of each magnitude
    routed = rows.float().view(t, k, h).sum(1)
    tol = 2 * (_ulp(routed) + _ulp(ref.float()))
    assert bool(((got.float() - ref.float()).abs() <= tol).all())


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """A bf16 ulp at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=1e-30))) - 7)
