"""Parity of the sparse/dense MLA kernel with its torch reference, and of the Triton MLA
backend with the torch MLA backend (cache write, graph padding, mixed dense/sparse)."""

from __future__ import annotations

import pytest
import torch
from _sparse_batch import sparse_batch

from pdserve.kernels.reference import to_fp8
from pdserve.kernels.sparse_mla import (
    CONFIG_WIDE,
    choose_splits,
    sparse_mla_attention,
    sparse_mla_reference,
)
from pdserve.layers.attention.mla import MLATorchBackend
from pdserve.layers.attention.mla_triton import MLATritonBackend

H, LAT, ROPE, PAGE = 20, 48, 8, 4  # heads not a multiple of the head block, odd widths


@pytest.mark.parametrize(
    "seq_lens,q_lens,k,splits,dtype",
    [
        ([5, 40, 70], [1, 1, 1], 16, 1, torch.float32),  # decode: one dense, two sparse
        ([9, 70], [3, 3], 16, 4, torch.float32),  # verify rows 1+k, split-K
        ([10, 5], [4, 3], None, 2, torch.float32),  # prompt chunks, no indexer: dense causal
        ([50, 33], [2, 2], 16, 2, torch.bfloat16),
    ],
)
def test_sparse_mla_matches_reference(
    device: torch.device,
    seq_lens: list[int],
    q_lens: list[int],
    k: int | None,
    splits: int,
    dtype: torch.dtype,
) -> None:
    g = torch.Generator().manual_seed(sum(seq_lens))
    sb = sparse_batch(seq_lens, q_lens, PAGE, g, device)
    md = sb.md
    t = md.num_actual_tokens
    cache = torch.randn(sb.num_blocks, PAGE, LAT + ROPE, generator=g).to(dtype).to(device)
    q_lat = torch.randn(t, H, LAT, generator=g).to(dtype).to(device)
    q_pe = torch.randn(t, H, ROPE, generator=g).to(dtype).to(device)
    topk = sb.random_topk(k, g) if k else None
    out = sparse_mla_attention(
        q_lat, q_pe, cache, md.block_tables, md.seq_lens, md.query_start_loc,
        md.token_req_idx, md.token_q_idx, topk, 0.15, t, splits,
    )  # fmt: skip
    ref = sparse_mla_reference(
        q_lat, q_pe, cache, md.block_tables, sb.positions, sb.req, topk, 0.15
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("prefill_variant", [None, "rows_n32_s5"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_triton_mla_backend_matches_torch_backend(
    device: torch.device, cache_dtype: torch.dtype, prefill_variant: str | None
) -> None:
    """Padded rows (graph padding) come back zero; both caches hold the same entries (an
    fp8 cache too: written saturated, read in the query dtype). With a prefill variant
    (every step counts as prefill here) the prefill kernel gives the same."""
    g = torch.Generator().manual_seed(7)
    sb = sparse_batch([6, 37, 21], [2, 2, 2], PAGE, g, device, pad_to=8)
    t, rows = sb.md.num_actual_tokens, 8
    latent = torch.randn(rows, LAT, generator=g).to(device)
    k_pe = torch.randn(rows, ROPE, generator=g).to(device)
    q_lat = torch.randn(rows, H, LAT, generator=g).to(device)
    q_pe = torch.randn(rows, H, ROPE, generator=g).to(device)
    topk = sb.random_topk(16, g, pad_to=rows)
    start = to_fp8(torch.randn(sb.num_blocks, PAGE, LAT + ROPE, generator=g)).to(cache_dtype)
    outs, caches = [], []
    triton_be = MLATritonBackend(max_model_len=64, prefill_variant=prefill_variant,
                                 prefill_min_tokens=1)  # fmt: skip
    for be in (MLATorchBackend(), triton_be):
        caches.append(start.clone().to(device))
        outs.append(be.forward(q_lat, q_pe, latent, k_pe, caches[-1], sb.md, 0.2, topk))
    assert torch.equal(caches[1].view(torch.uint8), caches[0].view(torch.uint8))
    torch.testing.assert_close(outs[1][:t], outs[0][:t], atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[1][t:], torch.zeros_like(outs[1][t:]))


def test_choose_splits_is_host_only_and_bounded() -> None:
    assert choose_splits(1, 64, 2048, 132) == 16  # a lone decode row splits its 2048 keys
    assert choose_splits(16, 64, 2048, 132) == 16
    assert choose_splits(64, 64, 2048, 132) == 2  # the wide config: one program per SM
    assert choose_splits(4096, 64, 2048, 132) == 1  # prefill: enough programs already
    assert choose_splits(1, 64, 100, 132) == 1  # too few keys to split


@pytest.mark.parametrize("heads,lat,rope", [(64, 32, 16), (20, 48, 8)])
def test_wide_config_matches_reference(
    device: torch.device, heads: int, lat: int, rope: int
) -> None:
    """The prefill/verify launch shape (every head of a token in one program, two
    warpgroups): with widths that are their tiles (no feature masks) and without, over a
    chunked prefill (cached prefix, rows within and beyond top-k) and a verify batch."""
    g = torch.Generator().manual_seed(heads + lat)
    sb = sparse_batch([40, 24, 9], [12, 4, 4], PAGE, g, device)
    md = sb.md
    t = md.num_actual_tokens
    cache = torch.randn(sb.num_blocks, PAGE, lat + rope, generator=g).to(device)
    q_lat = torch.randn(t, heads, lat, generator=g).to(device)
    q_pe = torch.randn(t, heads, rope, generator=g).to(device)
    topk = sb.random_topk(16, g)
    for splits in (1, 2):
        out = sparse_mla_attention(
            q_lat, q_pe, cache, md.block_tables, md.seq_lens, md.query_start_loc,
            md.token_req_idx, md.token_q_idx, topk, 0.2, t, splits, config=CONFIG_WIDE,
        )  # fmt: skip
        ref = sparse_mla_reference(
            q_lat, q_pe, cache, md.block_tables, sb.positions, sb.req, topk, 0.2
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_triton_mla_backend_refuses_an_unknown_prefill_variant() -> None:
    with pytest.raises(ValueError, match="prefill_variant"):
        MLATritonBackend(prefill_variant="fastest")
