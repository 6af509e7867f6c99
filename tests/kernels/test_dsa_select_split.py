"""The split top-k select (a row over several programs: a sample's bracket, candidates,
an exact pick among them, the radix select where the bracket misses) against
``torch.topk``: the same scores selected, exactly ``k`` distinct causal keys (-1 pads on
short rows, nothing stale), on distinct, tied, negative and NaN scores; and through the
Triton indexer backend where ``PDSERVE_SELECT_SPLIT_ROWS`` asks for it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from _sparse_batch import sparse_batch

from pdserve.kernels import dsa_select_split
from pdserve.kernels.dsa_indexer import indexer_topk_reference, topk_select
from pdserve.kernels.dsa_select_split import split_chunks, split_topk_select
from pdserve.layers.attention.dsa import IndexerTorchBackend
from pdserve.layers.attention.dsa_triton import IndexerTritonBackend

K = 64
SMALL = {"sample": 256, "cap": 256}  # interpreter-sized


def _rows(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """Placement of ``logits.shape[0]`` query rows of one request with ``n`` keys: the
    last rows of its context (positions n - rows .. n - 1)."""
    rows, dev = logits.shape[0], logits.device
    return (
        torch.tensor([n], dtype=torch.int32, device=dev),
        torch.tensor([0, rows], dtype=torch.int32, device=dev),
        torch.zeros(rows, dtype=torch.int64, device=dev),
        torch.arange(rows, device=dev),
    )


def _check(logits: torch.Tensor, n: int, got: torch.Tensor) -> None:
    for t in range(logits.shape[0]):
        pos = n - logits.shape[0] + t
        sel = got[t]
        assert sel.min() >= 0 and sel.max() <= pos and torch.unique(sel).numel() == K, t
        want = logits[t, : pos + 1].topk(K).values.sort().values
        assert torch.equal(logits[t][sel].sort().values, want), t


@triton.jit
def _mark_fallback(row, dst, n, K, BLOCK: tl.constexpr):
    tl.store(dst, -7)


@pytest.mark.parametrize("chunks", [1, 4, 16])
def test_split_select_takes_the_k_best(device: torch.device, chunks: int) -> None:
    g = torch.Generator().manual_seed(chunks)
    rows, n = 4, 900
    logits = torch.randn(rows, 1024, generator=g)
    logits[1] *= 1e-3  # close together
    logits[2] = -logits[2].abs()  # all negative
    logits[3, n - 300 :] += 4.0  # the best keys bunched at the end of the row
    logits = logits.to(device)
    out = torch.full((rows, K), 999, dtype=torch.int64, device=device)
    split_topk_select(logits, *_rows(logits, n), K, rows, out, chunks=chunks, **SMALL)
    _check(logits.cpu(), n, out.cpu())


@pytest.mark.skipif(torch.cuda.is_available(), reason="swaps a jit helper (interpreter)")
def test_bracket_holds_on_spread_scores_and_misses_on_ties(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Distinct scores: the sample's bracket holds (the exact fallback never runs). All
    scores tied: the candidates overflow and the row's first program falls back."""
    monkeypatch.setattr(dsa_select_split, "radix_select_row", _mark_fallback)
    g = torch.Generator().manual_seed(5)
    n = 1000
    logits = torch.randn(3, n, generator=g)
    logits[2] = 1.0
    out = torch.empty(3, K, dtype=torch.int64)
    split_topk_select(logits, *_rows(logits, n), K, 3, out, chunks=8, **SMALL)
    assert int(out[:2].min()) >= 0 and int(out[2, 0]) == -7


@pytest.mark.parametrize("cap", [16, 256])
def test_ties_negatives_and_nan_stay_exact(device: torch.device, cap: int) -> None:
    """The radix fallback (cap 16: every row's candidates overflow) and the bracket path
    on many equal scores: exactly k keys, the best ones; a NaN row leaves nothing stale."""
    g = torch.Generator().manual_seed(3)
    rows, n = 7, 700
    logits = torch.randint(0, 5, (rows, n), generator=g).float()
    logits[1] = 0.0  # all tied
    logits[2, :K] = -torch.arange(K, dtype=torch.float32) - 1.0
    logits[3] = torch.randn(n, generator=g)
    logits[4] = -torch.rand(n, generator=g) * 1e-3
    logits[4, ::3] = -0.0
    logits[5, 100:] = float("-inf")
    logits[6] = 1.0 + torch.randint(0, 300, (n,), generator=g).float() * 2.0**-23
    logits = logits.to(device)
    out = torch.full((rows, K), 999, dtype=torch.int64, device=device)
    split_topk_select(logits, *_rows(logits, n), K, rows, out, chunks=4, sample=256, cap=cap)
    _check(logits.cpu(), n, out.cpu())
    nan = torch.full((2, n), float("nan"), device=device)
    out = torch.full((2, K), 999, dtype=torch.int64, device=device)
    split_topk_select(nan, *_rows(nan, n), K, 2, out, chunks=4, sample=256, cap=cap)
    assert int(out.max()) < n and int(out.min()) >= -1


def test_short_rows_pad_and_auto_takes_the_split(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows within top-k take every causal key, -1 after; ``auto`` splits up to
    ``PDSERVE_SELECT_SPLIT_ROWS`` rows, and refuses a value that is not a count."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 128, generator=g).to(device)
    seq = torch.tensor([100, 9], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    req = torch.tensor([0, 0, 1], dtype=torch.int64, device=device)
    qidx = torch.tensor([0, 1, 0], dtype=torch.int64, device=device)
    monkeypatch.setenv("PDSERVE_SELECT_SPLIT_ROWS", "4")
    monkeypatch.setattr(dsa_select_split, "SPLIT_SAMPLE", 256)
    k = 16
    out = torch.full((3, k), 999, dtype=torch.int64, device=device)
    topk_select(logits, seq, qsl, req, qidx, k, 3, out)
    assert torch.equal(out[2].cpu(), torch.tensor(list(range(9)) + [-1] * 7))
    for t, pos in ((0, 98), (1, 99)):
        want = logits[t, : pos + 1].topk(k).values.sort().values
        assert torch.equal(logits[t][out[t]].sort().values, want)
    monkeypatch.setenv("PDSERVE_SELECT_SPLIT_ROWS", "many")
    with pytest.raises(ValueError, match="PDSERVE_SELECT_SPLIT_ROWS"):
        topk_select(logits, seq, qsl, req, qidx, k, 3, out)
    assert split_chunks(32768) == 32 and split_chunks(16384) == 16 and split_chunks(40) == 1


def test_indexer_backend_with_the_split_select(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton indexer backend on decode and verify rows with the split select picks
    the same scores as the torch backend."""
    monkeypatch.setenv("PDSERVE_SELECT_SPLIT_ROWS", "64")
    monkeypatch.setattr(dsa_select_split, "SPLIT_SAMPLE", 256)
    g = torch.Generator().manual_seed(12)
    nh, d, page, k = 8, 32, 4, 16
    sb = sparse_batch([12, 300, 45], [2, 2, 1], page, g, device, pad_to=8)
    t = sb.md.num_actual_tokens
    q = torch.randn(8, nh, d, generator=g).to(device)
    key = torch.randn(8, d, generator=g).to(device)
    w = torch.randn(8, nh, generator=g).to(device)
    start = torch.randn(sb.num_blocks, page, d, generator=g).to(device)
    outs, caches = [], []
    for be in (IndexerTorchBackend(), IndexerTritonBackend()):
        caches.append(start.clone())
        outs.append(be.forward(q, key, w, caches[-1], sb.md, k, d**-0.5))
    bt = sb.md.block_tables.long()
    keys = caches[0][bt].reshape(bt.shape[0], -1, d)
    scores, _ = indexer_topk_reference(q[:t], w[:t], keys, sb.positions, sb.req, d**-0.5, k)
    for r in range(t):
        a, b = outs[1][r], outs[0][r]
        a, b = a[a >= 0], b[b >= 0]
        assert a.numel() == b.numel() == torch.unique(a).numel(), r
        torch.testing.assert_close(scores[r][a].sort().values, scores[r][b].sort().values,
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
