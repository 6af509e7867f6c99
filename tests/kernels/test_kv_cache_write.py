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
