"""Parity of the prefill variants of the sparse MLA kernel (kernels/sparse_mla_prefill.py)
with the torch reference, and of its candidate-row resolution with the block table."""

from __future__ import annotations

import pytest
import torch
from _sparse_batch import sparse_batch

from pdserve.kernels.sparse_mla import sparse_mla_reference
from pdserve.kernels.sparse_mla_prefill import (
    VARIANTS,
    PrefillVariant,
    candidate_rows,
    sparse_mla_prefill,
)

PAGE = 4


def _batch(device: torch.device, heads: int, lat: int, rope: int, dtype: torch.dtype,
           seed: int):  # fmt: skip
    """A chunked prefill (cached prefix, rows beyond top-k 40), a chunk within top-k
    (dense causal), verify rows, and a chunk of a long prompt whose first rows have at
    most 40 causal keys (all of them, not the top-k's entries): every row but the
    shortest spans several tiles."""
    g = torch.Generator().manual_seed(seed)
    sb = sparse_batch([90, 36, 9, 60], [12, 4, 4, 30], PAGE, g, device)
    t = sb.md.num_actual_tokens
    cache = torch.randn(sb.num_blocks, PAGE, lat + rope, generator=g).to(dtype).to(device)
    q_lat = torch.randn(t, heads, lat, generator=g).to(dtype).to(device)
    q_pe = torch.randn(t, heads, rope, generator=g).to(dtype).to(device)
    topk = sb.random_topk(40, g)
    topk[0, 3] = -1  # a hole inside a row
    return sb, cache, q_lat, q_pe, topk


def test_candidate_rows_follow_the_block_table(device: torch.device) -> None:
    sb, _, _, _, topk = _batch(device, 4, 16, 16, torch.float32, 3)
    md, t = sb.md, sb.md.num_actual_tokens
    rows, ncand = candidate_rows(md.block_tables, md.seq_lens, md.query_start_loc,
                                 md.token_req_idx, md.token_q_idx, topk, PAGE, t)  # fmt: skip
    k = topk.shape[1]
    for i in range(t):
        pos, req = int(sb.positions[i]), int(sb.req[i])
        sparse = int(md.seq_lens[req]) > k and pos >= k  # else every causal key
        cand = topk[i].cpu() if sparse else torch.arange(pos + 1)
        assert int(ncand[i]) == (k if sparse else pos + 1)
        want = torch.full((k,), -1, dtype=torch.int64)
        for j, p in enumerate(cand.tolist()):
            if 0 <= p <= pos:
                want[j] = int(md.block_tables[req, p // PAGE]) * PAGE + p % PAGE
        assert torch.equal(rows[i].cpu().long(), want), i


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("heads,lat,rope,dtype", [(64, 32, 16, torch.float32),
                                                  (20, 48, 8, torch.float32),
                                                  (64, 32, 16, torch.bfloat16)])  # fmt: skip
def test_prefill_variants_match_reference(
    device: torch.device, name: str, heads: int, lat: int, rope: int, dtype: torch.dtype
) -> None:
    """Every variant (the widths as their tiles and not, a head count not a multiple of
    the head block, bf16), at a scale whose running maxima grow past the lazy variant's
    threshold (so its deferred rescale runs)."""
    sb, cache, q_lat, q_pe, topk = _batch(device, heads, lat, rope, dtype, heads + lat)
    md, t = sb.md, sb.md.num_actual_tokens
    rows, ncand = candidate_rows(md.block_tables, md.seq_lens, md.query_start_loc,
                                 md.token_req_idx, md.token_q_idx, topk, PAGE, t)  # fmt: skip
    for scale in (0.2, 2.5):
        out = sparse_mla_prefill(q_lat, q_pe, cache, rows, ncand, scale, t, variant=name)
        ref = sparse_mla_reference(
            q_lat, q_pe, cache, md.block_tables, sb.positions, sb.req, topk, scale
        )
        # float32: summation order differs from the reference's (scores over split
        # latent halves); sharper softmaxes at the large scale magnify it
        tol = (1e-5 if scale < 1 else 1e-4) if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_prefill_refuses_what_it_cannot_address(device: torch.device) -> None:
    sb, cache, q_lat, q_pe, topk = _batch(device, 4, 16, 16, torch.float32, 5)
    md, t = sb.md, sb.md.num_actual_tokens
    rows, ncand = candidate_rows(md.block_tables, md.seq_lens, md.query_start_loc,
                                 md.token_req_idx, md.token_q_idx, topk, PAGE, t)  # fmt: skip
    strided = torch.zeros(cache.shape[0], PAGE + 1, cache.shape[2], device=device)[:, :PAGE]
    with pytest.raises(ValueError, match="pages must be contiguous"):
        sparse_mla_prefill(q_lat, q_pe, strided, rows, ncand, 0.2, t)
    with pytest.raises(ValueError, match="int32"):
        sparse_mla_prefill(q_lat, q_pe, cache, rows.long(), ncand, 0.2, t)
    with pytest.raises(ValueError, match="lat_split"):
        sparse_mla_prefill(q_lat, q_pe, cache, rows, ncand, 0.2, t,
                           variant=PrefillVariant(64, 16, 4, 3, lat_split=4))  # fmt: skip
