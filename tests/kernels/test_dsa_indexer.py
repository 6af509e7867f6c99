"""Parity of the DSA indexer kernels (paged scores, radix top-k select) with torch, and
of the Triton indexer backend with the torch one. Selections are compared as sets of
scores: on exact ties either side may keep a different key of the same score. FP8 keys
(one float32 scale a key): the kernels against the reference over the dequantized keys,
and the quantization itself within e4m3's rounding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _sparse_batch import SparseBatch, sparse_batch

from pdserve.kernels import dsa_indexer_tiled
from pdserve.kernels.dsa_indexer import indexer_logits, indexer_topk_reference, topk_select
from pdserve.kernels.dsa_indexer_tiled import indexer_logits_tiled
from pdserve.kernels.dsa_select import reg_topk_select
from pdserve.kernels.index_cache import (
    dequantize_index_cache,
    fp8_index_row_bytes,
    indexer_cache_views,
    quantize_index_queries,
    write_index_keys,
)
from pdserve.layers.attention import dsa_triton
from pdserve.layers.attention.dsa import IndexerTorchBackend
from pdserve.layers.attention.dsa_triton import IndexerTritonBackend

NH, D, PAGE = 16, 32, 4


def _keys(sb: SparseBatch, cache: torch.Tensor) -> torch.Tensor:
    bt = sb.md.block_tables.long()
    return cache[bt].reshape(bt.shape[0], -1, cache.shape[-1])  # [B, S, D] by position


def _assert_same_selection(
    got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, tol: float
) -> None:
    """Per row: as many keys, causal, distinct, with the same multiset of scores."""
    for t in range(got.shape[0]):
        g, w = got[t][got[t] >= 0], want[t][want[t] >= 0]
        assert g.numel() == w.numel() == torch.unique(g).numel(), t
        gs, ws = scores[t][g].sort().values, scores[t][w].sort().values
        torch.testing.assert_close(gs, ws, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "seq_lens,q_lens,k,dtype",
    [
        ([5, 40, 300], [1, 1, 1], 16, torch.float32),  # decode: within top-k, beyond it
        ([30, 9], [7, 9], 16, torch.float32),  # prompt chunks: rows on both sides of k
        ([50, 1500], [2, 2], 64, torch.bfloat16),  # verify rows, a long context
    ],
)
def test_indexer_kernels_match_reference(
    device: torch.device, seq_lens: list[int], q_lens: list[int], k: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(sum(seq_lens))
    sb = sparse_batch(seq_lens, q_lens, PAGE, g, device)
    md, t = sb.md, sb.md.num_actual_tokens
    cache = torch.randn(sb.num_blocks, PAGE, D, generator=g).to(dtype).to(device)
    q = torch.randn(t, NH, D, generator=g).to(dtype).to(device)
    w = torch.randn(t, NH, generator=g).to(device)
    width = max(seq_lens)
    args = (md.seq_lens, md.query_start_loc, md.token_req_idx, md.token_q_idx)
    sparse = indexer_logits(q, w, cache, md.block_tables, *args, 0.2, t, width, k)
    got = topk_select(sparse, *args, k, t)
    full = indexer_logits(q, w, cache, md.block_tables, *args, 0.2, t, width, k, for_select=False)
    scores, want = indexer_topk_reference(q, w, _keys(sb, cache), sb.positions, sb.req, 0.2, k)
    scores = scores[:, :width]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full, scores, atol=tol, rtol=tol)  # -inf past each position
    _assert_same_selection(got, want, scores, tol)


@pytest.mark.parametrize("variant", ["rows_bits", "rows_hist"])
def test_select_breaks_ties_to_exactly_k(device: torch.device, variant: str) -> None:
    """Many equal scores (ReLU zeros, repeated values, -0.0 beside 0.0): exactly k keys,
    the best ones."""
    g = torch.Generator().manual_seed(3)
    rows, n, k = 7, 700, 64
    logits = torch.randint(0, 5, (rows, n), generator=g).float()
    logits[1] = 0.0  # all tied
    logits[2, :k] = -torch.arange(k, dtype=torch.float32) - 1.0  # negatives in the mix
    logits[3] = torch.randn(n, generator=g)  # distinct
    logits[4] = -torch.rand(n, generator=g) * 1e-3  # all negative, close together
    logits[4, ::3] = -0.0
    logits[5, 100:] = float("-inf")  # -inf past the first 100 keys
    # scores that differ only in their last mantissa bits: the low bytes decide, with ties
    ulp = torch.randint(0, 300, (n,), generator=g).float() * 2.0**-23
    logits[6] = 1.0 + ulp
    logits = logits.to(device)
    seq = torch.tensor([n], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, rows], dtype=torch.int32, device=device)
    req = torch.zeros(rows, dtype=torch.int64, device=device)
    qidx = torch.arange(rows, device=device)  # the last rows: positions n-4 .. n-1
    got = topk_select(logits, seq, qsl, req, qidx, k, rows, variant=variant)
    for t in range(rows):
        pos = n - rows + t
        ref = logits[t, : pos + 1].topk(k).values.sort().values
        sel = got[t]
        assert sel.min() >= 0 and sel.max() <= pos and torch.unique(sel).numel() == k
        assert torch.equal(logits[t][sel].sort().values, ref)


@pytest.mark.parametrize("tail", [4, 16])
def test_rows_just_past_half_the_buffer_take_two_tiles(device: torch.device, tail: int) -> None:
    """The register select's two-tile rows (``tail``): rows of a 1,024-wide buffer just past
    512 keys (the tail tile), past 512 + 256 (a quarter tile) and near 1,024 (one tile),
    with distinct and tied scores: exactly k keys, the best ones."""
    g = torch.Generator().manual_seed(tail)
    k = 64
    ns = [520, 700, 800, 1000]  # causal keys of rows 0..3 (one token a request)
    rows = len(ns)
    logits = torch.randn(rows, 1024, generator=g)
    logits[1, :600] = torch.randint(0, 3, (600,), generator=g).float() + 5.0  # many ties
    logits = logits.to(device)
    seq = torch.tensor(ns, dtype=torch.int32, device=device)
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=device)
    req = torch.arange(rows, device=device)
    qidx = torch.zeros(rows, dtype=torch.int64, device=device)
    out = torch.full((rows, k), 999, dtype=torch.int64, device=device)
    reg_topk_select(logits, seq, qsl, req, qidx, k, rows, out, tail=tail)
    for t, m in enumerate(ns):
        sel = out[t]
        assert sel.min() >= 0 and sel.max() < m and torch.unique(sel).numel() == k, t
        want = logits[t, :m].topk(k).values.sort().values
        assert torch.equal(logits[t][sel].sort().values, want), t
    with pytest.raises(ValueError, match="power of two"):
        reg_topk_select(logits, seq, qsl, req, qidx, k, rows, out, tail=6)


@pytest.mark.parametrize("variant", ["rows_bits", "rows_hist", "radix"])
def test_select_writes_every_slot_of_a_stale_buffer(device: torch.device, variant: str) -> None:
    """The register select needs no -1 fill before it (the decode path passes an empty
    buffer): short rows pad with -1, long ones get k positions, NaN rows keep no stale
    slot; the radix select fills its buffer itself."""
    rows, n, k = 3, 40, 16
    logits = torch.randn(rows, n, generator=torch.Generator().manual_seed(4)).to(device)
    logits[1] = float("nan")
    seq = torch.tensor([n, 9], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    req = torch.tensor([0, 0, 1], dtype=torch.int64, device=device)
    qidx = torch.tensor([0, 1, 0], dtype=torch.int64, device=device)
    out = torch.full((rows, k), 999, dtype=torch.int64, device=device)
    topk_select(logits, seq, qsl, req, qidx, k, rows, out, variant=variant)
    assert int(out.max()) < n and int(out.min()) >= -1  # NaN row 1 included: nothing stale
    assert torch.unique(out[0]).numel() == k  # position 38: k of its 39 keys
    assert torch.equal(out[2], torch.tensor(list(range(9)) + [-1] * 7, device=device))


def fp8_cache(
    num_blocks: int, g: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(an fp8 indexer cache [blocks, PAGE * (D + 4)] uint8 filled with random keys of
    magnitudes spread over three decades, those keys float32 [blocks, PAGE, D])."""
    raw = torch.zeros(num_blocks, PAGE * fp8_index_row_bytes(D), dtype=torch.uint8)
    raw = raw.to(device)
    vals = torch.randn(num_blocks * PAGE, D, generator=g)
    vals *= 10 ** (3 * torch.rand(num_blocks * PAGE, 1, generator=g) - 2)
    keys, scales = indexer_cache_views(raw, D)
    write_index_keys(keys, scales, torch.arange(num_blocks * PAGE, device=device), vals.to(device))
    return raw, vals.view(num_blocks, PAGE, D).to(device)


def test_fp8_keys_round_within_e4m3(device: torch.device) -> None:
    """Each key: ``k ≈ k_fp8 * s`` with ``s = amax / 448`` (its own, however small or
    large the key), within half an e4m3 step (2^-4 relative; 2^-10 * s for subnormals);
    the scales sit after the block's keys, the keys 16-byte aligned."""
    g = torch.Generator().manual_seed(5)
    raw, vals = fp8_cache(6, g, device)
    keys, scales = indexer_cache_views(raw, D)
    assert scales is not None and scales.shape == (6, PAGE) and keys.shape == (6, PAGE, D)
    assert keys.stride() == (PAGE * (D + 4), D, 1) and scales.stride() == (PAGE * (D + 4) // 4, 1)
    assert (keys.data_ptr() - raw.data_ptr(), scales.data_ptr() - raw.data_ptr()) == (0, PAGE * D)
    want = vals.abs().amax(-1) / 448
    torch.testing.assert_close(scales, want, atol=0, rtol=1e-6)
    deq = dequantize_index_cache(raw, D)
    err = (deq - vals).abs()
    assert bool((err <= vals.abs() * 2**-4 + scales[..., None] * 2**-10).all())


@pytest.mark.parametrize(
    "seq_lens,q_lens,dtype,fp8_q,verify",
    [
        ([5, 40, 300], [1, 1, 1], torch.float32, False, "rows"),  # decode kernel
        ([30, 50], [7, 2], torch.float32, False, "rows"),  # tiled: prompt, verify rows
        ([30, 50], [7, 2], torch.float32, False, "keys"),  # verify rows as MMA columns
        ([60, 20], [1, 3], torch.bfloat16, False, "rows"),  # both launch kinds, bf16 queries
        ([5, 40, 300], [1, 1, 1], torch.bfloat16, True, "rows"),  # fp8 queries: FP8 MMAs
        ([30, 50], [20, 2], torch.bfloat16, True, "rows"),
        ([30, 50], [20, 2], torch.bfloat16, True, "keys"),
    ],
)
def test_fp8_key_scores_match_dequantized_reference(
    device: torch.device, seq_lens: list[int], q_lens: list[int], dtype: torch.dtype,
    fp8_q: bool, verify: str,
) -> None:  # fmt: skip
    """Scores over fp8 keys equal the reference's over the dequantized keys (the only
    difference: where each key's scale multiplies), and the selection matches. With fp8
    queries (their scales folded into the weights) the reference takes the dequantized
    queries: the same products, summed in another order (float32 tolerance)."""
    g = torch.Generator().manual_seed(sum(seq_lens) + 1)
    sb = sparse_batch(seq_lens, q_lens, PAGE, g, device)
    md, t, k = sb.md, sb.md.num_actual_tokens, 16
    raw, _ = fp8_cache(sb.num_blocks, g, device)
    keys, scales = indexer_cache_views(raw, D)
    q = torch.randn(t, NH, D, generator=g).to(dtype).to(device)
    w = torch.randn(t, NH, generator=g).to(device)
    if fp8_q:
        q, w = quantize_index_queries(q, w)
    width = -(-max(seq_lens) // PAGE) * PAGE
    args = (md.seq_lens, md.query_start_loc, md.token_req_idx, md.token_q_idx)
    if md.max_query_len == 1:
        full = indexer_logits(q, w, keys, md.block_tables, *args, 0.2, t, width, k,
                              for_select=False, k_scale=scales)  # fmt: skip
    else:
        full = indexer_logits_tiled(
            q, w, keys, md.block_tables, md.seq_lens, md.query_start_loc, md.num_reqs,
            md.max_query_len, 0, t, 0.2, width, k, for_select=False, k_scale=scales,
            verify=replace(dsa_indexer_tiled.VERIFY_TILE, variant=verify),
        )  # fmt: skip
    deq = _keys(sb, dequantize_index_cache(raw, D))
    q_ref = q.float() if fp8_q else q
    scores, want = indexer_topk_reference(q_ref, w, deq, sb.positions, sb.req, 0.2, k)
    scores = scores[:, :width]
    big = float(scores[scores > float("-inf")].abs().max())
    # of the largest |score|; Hopper's FP8 MMAs keep about 14 bits of the float32 sum
    tol = 1e-2 if dtype != torch.float32 and not fp8_q else 1e-5
    if fp8_q and device.type == "cuda":
        tol = 5e-4
    torch.testing.assert_close(full, scores, atol=tol * big, rtol=tol)
    got = topk_select(full, *args, k, t)
    _assert_same_selection(got, want, scores, tol * big)


@pytest.mark.parametrize(
    "sort_free_max_width,fp8", [(32768, False), (16, False), (32768, True), (16, True)]
)
def test_triton_indexer_backend_matches_torch_backend(
    device: torch.device, sort_free_max_width: int, fp8: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both selection paths: the radix select, and torch.topk for wide rows; model-dtype
    and fp8 key caches (both backends write the same bytes)."""
    monkeypatch.setattr(dsa_triton, "SORT_FREE_MAX_WIDTH", sort_free_max_width)
    g = torch.Generator().manual_seed(11)
    sb = sparse_batch([12, 45, 20], [2, 2, 2], PAGE, g, device, pad_to=8)
    t, rows, k = sb.md.num_actual_tokens, 8, 16
    q = torch.randn(rows, NH, D, generator=g).to(device)
    key = torch.randn(rows, D, generator=g).to(device)
    w = torch.randn(rows, NH, generator=g).to(device)
    if fp8:
        start, _ = fp8_cache(sb.num_blocks, g, device)
    else:
        start = torch.randn(sb.num_blocks, PAGE, D, generator=g).to(device)
    outs, caches = [], []
    for be in (IndexerTorchBackend(), IndexerTritonBackend()):
        caches.append(start.clone())
        outs.append(be.forward(q, key, w, caches[-1], sb.md, k, D**-0.5))
    assert torch.equal(caches[1], caches[0])
    assert outs[1].shape == outs[0].shape == (rows, k) and outs[1].dtype == torch.int64
    keys = dequantize_index_cache(caches[0], D)
    scores, _ = indexer_topk_reference(q[:t], w[:t], _keys(sb, keys), sb.positions, sb.req,
                                       D**-0.5, k)  # fmt: skip
    _assert_same_selection(outs[1][:t], outs[0][:t], scores, 1e-5)
