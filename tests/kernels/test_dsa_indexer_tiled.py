"""Parity of the query-tiled DSA indexer scores (each formulation) and of the
register top-k select with the torch reference: prefill tiles (several, partial, across
requests), a cached prefix, verify-shaped batches, top-k wider than the context, a CUDA
graph's width past every context, token chunks that cut requests, and a mixed batch that
takes both launches. Tiny shapes: each case runs in seconds under the interpreter."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _sparse_batch import SparseBatch, sparse_batch
from test_dsa_indexer import _assert_same_selection, _keys

from pdserve.kernels import dsa_indexer_tiled, dsa_select
from pdserve.kernels.dsa_indexer import indexer_topk_reference, topk_select
from pdserve.kernels.dsa_indexer_tiled import TileConfig, indexer_logits_tiled
from pdserve.kernels.dsa_select import reg_topk_select
from pdserve.layers.attention.dsa import IndexerTorchBackend
from pdserve.layers.attention.dsa_triton import IndexerTritonBackend

NH, D, PAGE, SCALE = 4, 16, 4, 0.25
TOL = 1e-4  # float32 inputs: the kernels' and the reference's sums differ in order only
# small tiles so a few dozen tokens make several tiles and key ranges
PREFILL = {
    "heads": TileConfig("heads", bt=16, bn=16, span=32, num_warps=4, num_stages=2),
    "rows": TileConfig("rows", bt=8, bn=16, span=32, num_warps=4, num_stages=2),
    "keys": TileConfig("keys", bt=8, bn=16, span=32, num_warps=4, num_stages=2),
}
VERIFY = TileConfig("rows", bt=4, bn=16, span=32, num_warps=4, num_stages=2)
# the verify launch of each variant's test: "keys" runs there too (its engine use)
VERIFY_OF = {"heads": VERIFY, "rows": VERIFY, "keys": replace(VERIFY, variant="keys")}


def _inputs(
    seq_lens: list[int], q_lens: list[int], device: torch.device, width_pad: int = 0
) -> tuple[SparseBatch, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(sum(seq_lens) + len(q_lens))
    sb = sparse_batch(seq_lens, q_lens, PAGE, g, device)
    width = -(-max(seq_lens) // PAGE) * PAGE + width_pad
    if width_pad:  # a graph's width: block-table columns past the contexts are null
        sb.md.block_tables = torch.nn.functional.pad(
            sb.md.block_tables, (0, width // PAGE - sb.md.block_tables.shape[1])
        )
    t = sb.md.num_actual_tokens
    cache = torch.randn(sb.num_blocks, PAGE, D, generator=g).to(device)
    q = torch.randn(t, NH, D, generator=g).to(device)
    w = torch.randn(t, NH, generator=g).to(device)
    return sb, cache, q, w, width


def _scores(
    sb: SparseBatch,
    cache: torch.Tensor,
    q: torch.Tensor,
    w: torch.Tensor,
    width: int,
    topk: int,
    lo: int,
    hi: int,
    for_select: bool,
    prefill: TileConfig,
    verify: TileConfig = VERIFY,
) -> torch.Tensor:
    md = sb.md
    uniform = md.num_actual_tokens == md.num_reqs * md.max_query_len
    return indexer_logits_tiled(
        q, w, cache, md.block_tables, md.seq_lens, md.query_start_loc, md.num_reqs,
        md.max_query_len, lo, hi, SCALE, width, topk, for_select=for_select, uniform=uniform,
        prefill=prefill, verify=verify,
    )  # fmt: skip


def _reference(
    sb: SparseBatch, cache: torch.Tensor, q: torch.Tensor, w: torch.Tensor, width: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    keys = _keys(sb, cache)
    if keys.shape[1] < width:
        keys = torch.nn.functional.pad(keys, (0, 0, 0, width - keys.shape[1]))
    scores, want = indexer_topk_reference(q, w, keys[:, :width], sb.positions, sb.req, SCALE, k)
    return scores, want


CASES = {
    # (seq_lens, q_lens, topk, width_pad)
    "prefill": ([70], [70], 16, 0),  # 5 tiles of 16 (the last partial), 3 key ranges
    "cached_prefix": ([90, 29], [37, 29], 16, 0),  # a second chunk after 53 cached tokens
    "requests": ([30, 75, 12], [30, 20, 12], 16, 0),  # lengths differ; one within top-k
    "verify": ([40, 66, 9, 23], [4, 4, 4, 4], 16, 0),  # 1+3 rows a request (one launch)
    "verify_tiles": ([40, 66, 30], [6, 5, 6], 16, 0),  # two verify tiles of 4 rows
    "topk_over_context": ([40, 20], [25, 20], 64, 0),  # nothing scored for the select
    "graph_width": ([33, 50], [4, 4], 16, 40),  # width past every context
    "mixed": ([60, 50, 35], [40, 1, 3], 16, 0),  # both launches: > 8 and <= 8 rows
}


@pytest.mark.parametrize("variant", list(PREFILL))
@pytest.mark.parametrize("case", list(CASES))
def test_tiled_scores_and_selects_match_reference(
    device: torch.device, case: str, variant: str
) -> None:
    seq_lens, q_lens, k, pad = CASES[case]
    sb, cache, q, w, width = _inputs(seq_lens, q_lens, device, pad)
    md, t = sb.md, sb.md.num_actual_tokens
    scores, want = _reference(sb, cache, q, w, width, k)
    cfg, vcfg = PREFILL[variant], VERIFY_OF[variant]
    # every score, -inf past each position (the torch.topk path)
    full = _scores(sb, cache, q, w, width, k, 0, t, False, cfg, vcfg)
    torch.testing.assert_close(full, scores, atol=TOL, rtol=TOL)
    # the select's input: causal scores of the rows a select reads
    sparse = _scores(sb, cache, q, w, width, k, 0, t, True, cfg, vcfg)
    scored = (md.seq_lens.long()[sb.req] > k) & (sb.positions + 1 > k)
    causal = torch.arange(width, device=device)[None, :] <= sb.positions[:, None]
    m = scored[:, None] & causal
    torch.testing.assert_close(sparse[m], scores[m], atol=TOL, rtol=TOL)
    place = (md.seq_lens, md.query_start_loc, md.token_req_idx, md.token_q_idx)
    for select in ("rows", "radix"):
        got = topk_select(sparse, *place, k, t, variant=select)
        _assert_same_selection(got, want, scores, TOL)
        # rows not scored take every causal key, in position order
        j = torch.arange(k, device=device)[None, :]
        take_all = torch.where(j <= sb.positions[:, None], j, -1)
        assert torch.equal(got[~scored], take_all[~scored])


@pytest.mark.parametrize("variant", list(PREFILL))
def test_token_chunks_cut_requests(device: torch.device, variant: str) -> None:
    """Chunks [lo, hi) that start and end inside requests write rows lo..hi only."""
    seq_lens, q_lens = [50, 61, 3], [26, 41, 3]
    sb, cache, q, w, width = _inputs(seq_lens, q_lens, device)
    t, k = sb.md.num_actual_tokens, 16
    scores, _ = _reference(sb, cache, q, w, width, k)
    for lo, hi in ((0, 11), (11, 45), (45, t)):
        got = _scores(sb, cache, q, w, width, k, lo, hi, False, PREFILL[variant],
                      VERIFY_OF[variant])  # fmt: skip
        assert got.shape == (hi - lo, width)
        torch.testing.assert_close(got, scores[lo:hi], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("chunk", [2048, 32])
def test_register_select_ties_and_short_rows(
    device: torch.device, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exactly k keys on ties (lowest positions first), negatives, rows on each size
    class of a wide buffer (a quarter, a half, the whole), and rows within k; the
    writing pass in one chunk and in several."""
    monkeypatch.setattr(dsa_select, "REG_SELECT_CHUNK", chunk)
    g = torch.Generator().manual_seed(5)
    n, k = 256, 24
    rows = torch.tensor([20, 50, 100, 180, 255, 255])  # positions (n = pos + 1 keys)
    logits = torch.randint(0, 6, (rows.numel(), n), generator=g).float()
    logits[4] = 0.0  # all tied: positions 0..k-1
    logits[5, : k + 3] = -torch.arange(k + 3, dtype=torch.float32) - 0.5  # negatives
    logits = logits.to(device)
    r = rows.numel()
    seq = torch.tensor([n], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
    req = torch.zeros(r, dtype=torch.int64, device=device)
    qidx = rows.to(device)
    out = torch.full((r, k), -1, dtype=torch.int64, device=device)
    got = reg_topk_select(logits, seq, qsl, req, qidx, k, r, out)
    for i, pos in enumerate(rows.tolist()):
        sel = got[i]
        if pos + 1 <= k:
            assert (
                torch.equal(sel[: pos + 1].cpu(), torch.arange(pos + 1))
                and (sel[pos + 1 :] == -1).all()
            )
            continue
        assert sel.min() >= 0 and sel.max() <= pos and torch.unique(sel).numel() == k
        ref = logits[i, : pos + 1].topk(k).values.sort().values
        assert torch.equal(logits[i][sel].sort().values, ref)
        thr = ref[0]
        eq = sel[logits[i][sel] == thr].sort().values
        first = torch.nonzero(logits[i, : pos + 1] == thr).flatten()[: eq.numel()]
        assert torch.equal(eq, first)  # ties: the lowest positions
    assert torch.equal(got[4].sort().values.cpu(), torch.arange(k))


def test_backend_prefill_and_mixed_steps_match_torch_backend(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's dispatch: a prefill chunk with a cached prefix next to decode and
    verify-sized requests (both tiled launches, the module's default configs)."""
    monkeypatch.setattr(dsa_indexer_tiled, "SMALL_QUERY_ROWS", 4)
    g = torch.Generator().manual_seed(7)
    sb = sparse_batch([45, 30, 70], [20, 1, 4], PAGE, g, device)
    t, k = sb.md.num_actual_tokens, 16
    q = torch.randn(t, NH, D, generator=g).to(device)
    key = torch.randn(t, D, generator=g).to(device)
    w = torch.randn(t, NH, generator=g).to(device)
    start = torch.randn(sb.num_blocks, PAGE, D, generator=g).to(device)
    outs, caches = [], []
    for be in (IndexerTorchBackend(), IndexerTritonBackend()):
        caches.append(start.clone())
        outs.append(be.forward(q, key, w, caches[-1], sb.md, k, SCALE))
    assert torch.equal(caches[1], caches[0])
    scores, _ = indexer_topk_reference(q, w, _keys(sb, caches[0]), sb.positions, sb.req, SCALE, k)
    _assert_same_selection(outs[1], outs[0], scores, TOL)
