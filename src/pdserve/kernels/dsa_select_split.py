"""Top-k select of a few long DSA score rows, each split over several programs.

Same contract as :func:`~pdserve.kernels.dsa_indexer.topk_select`: per token the ``K``
causal positions of its best scores, the ones equal to the K-th best taken lowest
position first, -1 pads; rows with ``pos + 1 <= K`` keys (or whose request's context is
at most ``K``) take every causal key without reading the row.

Why: the register select (:mod:`~pdserve.kernels.dsa_select`) gives a row one program,
which at a decode batch of one leaves all but one multiprocessor idle; its ~20 row-wide
reductions are a chain of block barriers (a 16K-key row in the 32K-wide buffer of a
decode graph took 37 us a layer on the H200, RESULTS.md run 137). Here a row is read by
``P`` programs, and no program reduces over more than a chunk of it or a small candidate
set:

1. **Scan** (``_scan_kernel``, grid ``(rows, P)``). Every program of a row draws the same
   deterministic sample of ``SAMPLE`` keys (positions ``i * n // SAMPLE``) and finds two
   of its order statistics, around the rank ``r = K * SAMPLE / n`` where the row's K-th
   key is expected, ``margin * sqrt(r) + 2`` ranks either side: ``hi`` above it, ``lo``
   below (a bit-by-bit search for both at once). Its chunk of the row (``cdiv(n, P)``
   keys) then splits three ways: keys above ``hi`` (surely in the top ``K`` if fewer than
   ``K`` are above it in the whole row), keys in ``[lo, hi]`` (candidates), the rest. It
   writes both lists in position order, and their counts, to scratch.
2. **Pick** (``_pick_kernel``, grid ``(rows, P)``). Every program reads the ``P`` counts.
   The bracket holds when fewer than ``K`` keys are above ``hi``, at least ``K`` at or
   above ``lo``, and the candidates fit ``CAP``: then each program gathers all the
   candidates (in position order), finds the ``(K - above)``-th largest among them
   (bit by bit over ``CAP`` keys, from the first bit where ``lo`` and ``hi`` differ:
   every candidate shares the bits above it), and writes its
   own chunk's share: its keys above ``hi``, then its candidates taken, each at its slot
   in the row's order (the keys above ``hi`` in position order, then the candidates
   taken in position order, those above the K-th before its ties). Where the bracket
   fails (a sample far off the row, or so many ties that the candidates overflow) the
   row's first program selects exactly by the radix passes over memory
   (:func:`~pdserve.kernels.dsa_select.radix_select_row`): correct, only slower.

Each key is read twice from L2 and compared a few times; the reductions are over the
chunk, the sample and the candidates. Nothing is atomic and no program waits for
another, so it runs under CUDA graphs and Triton's interpreter alike (the scratch is
``torch.empty``: every program writes its counts before the pick reads them).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import next_pow2, pdl_args, pdl_enter
from pdserve.kernels.dsa_select import (
    _keys_of,
    _kth_key_bits_from,
    radix_select_row,
    row_extent,
    write_every_key,
    write_none,
)

SPLIT_ROWS_ENV = "PDSERVE_SELECT_SPLIT_ROWS"
SPLIT_ROWS = 0  # rows up to which topk_select's "auto" splits (0: never; not yet measured)
SPLIT_CHUNK_KEYS = 1024  # keys of the buffer's width a program scans: P = width / this ...
SPLIT_MAX_CHUNKS = 32  # ... at most this many
SPLIT_SAMPLE = 2048  # the sample's keys
SPLIT_MARGIN = 3.5  # the bracket's half-width in standard deviations of the sample rank
SPLIT_CAP = 2048  # candidates the pick holds (more: the exact fallback)
SPLIT_WARPS = (4, 8)  # scan, pick
RADIX_BLOCK = 4096  # the fallback's keys a step


def split_rows() -> int:
    """Rows up to which ``topk_select(variant="auto")`` takes this select:
    ``PDSERVE_SELECT_SPLIT_ROWS`` if set, else :data:`SPLIT_ROWS`."""
    mode = os.environ.get(SPLIT_ROWS_ENV)
    if mode is not None and not mode.isdigit():
        raise ValueError(f"{SPLIT_ROWS_ENV} must be a number of rows (got {mode!r})")
    return SPLIT_ROWS if mode is None else int(mode)


@triton.jit
def _two_kth_keys(key, r_hi, r_lo, BLOCK: tl.constexpr):
    """(the ``r_hi``-th and the ``r_lo``-th largest of ``key``, 1 <= r <= BLOCK): bit by
    bit for both at once (two 1-D reductions a step: a [BLOCK, 2] compare costs layout
    shuffles), stopping once each count is exact."""
    hi = tl.zeros([], tl.uint32)
    lo = tl.zeros([], tl.uint32)
    c_hi = tl.full([], BLOCK, tl.int32)
    c_lo = tl.full([], BLOCK, tl.int32)
    top = tl.full([], 2147483648, tl.uint32)
    b = tl.zeros([], tl.int32)
    while (b < 32) & ((c_hi != r_hi) | (c_lo != r_lo)):
        bit = top >> b.to(tl.uint32)
        n_hi = tl.sum((key >= (hi | bit)).to(tl.int32))
        n_lo = tl.sum((key >= (lo | bit)).to(tl.int32))
        hi = tl.where(n_hi >= r_hi, hi | bit, hi)
        c_hi = tl.where(n_hi >= r_hi, n_hi, c_hi)
        lo = tl.where(n_lo >= r_lo, lo | bit, lo)
        c_lo = tl.where(n_lo >= r_lo, n_lo, c_lo)
        b += 1
    return hi, lo


@triton.jit
def _scan_kernel(
    logits_ptr,
    seq_lens_ptr,
    qsl_ptr,
    req_ptr,
    qidx_ptr,
    counts_ptr,  # [T, P, 2] int32: keys above hi, candidates
    above_ptr,  # [T, P, K] int32
    cand_ptr,  # [T, P, CAP] int32
    bounds_ptr,  # [T, 2] int32: the bracket's lo and hi keys (their bits)
    stride_lt,
    K,
    margin,
    P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SAMPLE: tl.constexpr,
    CAP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    seq_len, n = row_extent(seq_lens_ptr, qsl_ptr, req_ptr, qidx_ptr, t)
    if (n > K) & (seq_len > K):
        row = logits_ptr + t * stride_lt
        i = tl.arange(0, SAMPLE).to(tl.int64)
        skey = _keys_of(tl.load(row + i * n // SAMPLE))
        r = (K * SAMPLE) / n.to(tl.float32)  # the K-th key's expected rank in the sample
        m = margin * tl.sqrt(r) + 2.0
        r_hi = tl.maximum(r - m, 0.0).to(tl.int32)  # 0: no key is surely in
        r_lo = tl.minimum(r + m + 1.0, SAMPLE + 1.0).to(tl.int32)  # past SAMPLE: all in
        hi, lo = _two_kth_keys(skey, tl.maximum(r_hi, 1), tl.minimum(r_lo, SAMPLE), SAMPLE)
        hi = tl.where(r_hi == 0, tl.full([], 4294967295, tl.uint32), hi)
        lo = tl.where(r_lo > SAMPLE, tl.zeros([], tl.uint32), lo)
        if c == 0:
            tl.store(bounds_ptr + t * 2, lo.to(tl.int32, bitcast=True))
            tl.store(bounds_ptr + t * 2 + 1, hi.to(tl.int32, bitcast=True))
        span = tl.cdiv(n, P)
        s = c * span + tl.arange(0, BLOCK_C)
        ok = (s < c * span + span) & (s < n)
        key = _keys_of(tl.load(row + s, mask=ok, other=0.0))
        above = ok & (key > hi)
        mid = ok & (key >= lo) & (key <= hi)
        at = (t * P + c).to(tl.int64)
        rank = tl.cumsum(above.to(tl.int32), 0) - 1
        tl.store(above_ptr + at * K + rank, s.to(tl.int32), mask=above & (rank < K))
        rank = tl.cumsum(mid.to(tl.int32), 0) - 1
        tl.store(cand_ptr + at * CAP + rank, s.to(tl.int32), mask=mid & (rank < CAP))
        tl.store(counts_ptr + at * 2, tl.sum(above.to(tl.int32)))
        tl.store(counts_ptr + at * 2 + 1, tl.sum(mid.to(tl.int32)))


@triton.jit
def _pick_kernel(
    logits_ptr,
    seq_lens_ptr,
    qsl_ptr,
    req_ptr,
    qidx_ptr,
    counts_ptr,
    above_ptr,
    cand_ptr,
    bounds_ptr,
    out_ptr,
    stride_lt,
    stride_ot,
    K,
    P: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RADIX_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    seq_len, n = row_extent(seq_lens_ptr, qsl_ptr, req_ptr, qidx_ptr, t)
    dst = out_ptr + t * stride_ot
    if (n <= K) | (seq_len <= K):
        if c == 0:
            write_every_key(dst, n, K, BLOCK_K)
    else:
        row = logits_ptr + t * stride_lt
        base = (t * P).to(tl.int64)
        j = tl.arange(0, CAP)
        chunk = tl.zeros([CAP], tl.int32)  # the chunk a candidate slot j comes from
        start = tl.zeros([CAP], tl.int32)  # and that chunk's first slot
        n_above = tl.zeros([], tl.int32)
        above_before = tl.zeros([], tl.int32)  # keys above hi in the chunks before c
        n_cand = tl.zeros([], tl.int32)
        for cc in tl.static_range(P):
            a_cc = tl.load(counts_ptr + (base + cc) * 2)
            n_cand += tl.load(counts_ptr + (base + cc) * 2 + 1)
            past = j >= n_cand
            chunk += past.to(tl.int32)
            start = tl.where(past, n_cand, start)
            above_before += tl.where(cc < c, a_cc, 0)
            n_above += a_cc
        if (n_above < K) & (n_above + n_cand >= K) & (n_cand <= CAP):
            valid = j < n_cand
            cpos = tl.load(cand_ptr + (base + chunk) * CAP + j - start, mask=valid, other=0)
            key = _keys_of(tl.load(row + cpos, mask=valid, other=0.0))
            key = tl.where(valid, key, tl.zeros_like(key))  # below every real key
            need = K - n_above
            # every candidate lies in [lo, hi]: the bits above their first difference are
            # known, so the search starts below them
            lo = tl.load(bounds_ptr + t * 2).to(tl.uint32, bitcast=True)
            diff = lo ^ tl.load(bounds_ptr + t * 2 + 1).to(tl.uint32, bitcast=True)
            b = tl.zeros([], tl.int32)
            while (b < 32) & (((diff >> (31 - b).to(tl.uint32)) & 1) == 0):
                b += 1
            one = tl.full([], 1, tl.int64)
            known = ((one << 32) - (one << (32 - b).to(tl.int64))).to(tl.uint32)  # top b bits
            thr = lo & known
            cnt = tl.where(thr > 0, n_cand, CAP)  # count(key >= thr): padding keys are 0
            thr, n_ge = _kth_key_bits_from(key, need, thr, cnt, b)
            if n_ge == need:  # the candidates at or above thr are exactly the ones needed
                take = valid & (key >= thr)
            else:  # ties at the K-th key: the first ones equal to it
                gt = valid & (key > thr)
                eq = valid & (key == thr)
                eq_rank = tl.cumsum(eq.to(tl.int32), 0) - 1
                take = gt | (eq & (eq_rank < need - tl.sum(gt.to(tl.int32))))
            slot = n_above + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(dst + slot, cpos.to(tl.int64), mask=take & (chunk == c))
            mine = tl.load(counts_ptr + (base + c) * 2)
            for k0 in range(0, mine, BLOCK_K):
                i = k0 + tl.arange(0, BLOCK_K)
                apos = tl.load(above_ptr + (base + c) * K + i, mask=i < mine, other=0)
                tl.store(dst + above_before + i, apos.to(tl.int64), mask=i < mine)
        elif c == 0:  # the bracket missed: select exactly, -1 first (nothing stale)
            write_none(dst, K, BLOCK_K)
            tl.debug_barrier()
            radix_select_row(row, dst, n, K, RADIX_BLOCK)


def split_chunks(width: int) -> int:
    """Programs a row of ``width`` keys is split over (a power of two)."""
    return next_pow2(max(1, min(SPLIT_MAX_CHUNKS, -(-width // SPLIT_CHUNK_KEYS))))


def split_topk_select(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req_idx: torch.Tensor,
    token_q_idx: torch.Tensor,
    topk: int,
    num_tokens: int,
    out: torch.Tensor,
    chunks: int | None = None,
    sample: int = SPLIT_SAMPLE,
    cap: int = SPLIT_CAP,
    margin: float = SPLIT_MARGIN,
    warps: tuple[int, int] = SPLIT_WARPS,
) -> torch.Tensor:
    """Fill ``out`` [num_tokens, topk] (every slot of those rows is written; -1 pads) from
    score rows ``logits`` [>= num_tokens, width] float32, each row over ``chunks``
    programs (a power of two; default :func:`split_chunks` of the width); ``warps``: the
    scan's and the pick's."""
    width = logits.shape[1]
    p = chunks or split_chunks(width)
    if p & (p - 1) or sample & (sample - 1) or cap & (cap - 1):
        raise ValueError(f"chunks, sample and cap must be powers of two: {p}, {sample}, {cap}")
    if num_tokens == 0:
        return out
    dev = logits.device
    counts = torch.empty(num_tokens, p, 2, dtype=torch.int32, device=dev)
    bounds = torch.empty(num_tokens, 2, dtype=torch.int32, device=dev)
    above = torch.empty(num_tokens, p, topk, dtype=torch.int32, device=dev)
    cand = torch.empty(num_tokens, p, cap, dtype=torch.int32, device=dev)
    place = (seq_lens, query_start_loc, token_req_idx, token_q_idx)
    _scan_kernel[(num_tokens, p)](
        logits, *place, counts, above, cand, bounds, logits.stride(0), topk, margin,
        P=p, BLOCK_C=max(16, next_pow2(-(-width // p))), SAMPLE=sample, CAP=cap,
        num_warps=warps[0], **pdl_args(dev),
    )  # fmt: skip
    _pick_kernel[(num_tokens, p)](
        logits, *place, counts, above, cand, bounds, out, logits.stride(0), out.stride(0), topk,
        P=p, CAP=cap, BLOCK_K=min(1024, next_pow2(topk)), RADIX_BLOCK=RADIX_BLOCK,
        num_warps=warps[1], **pdl_args(dev),
    )  # fmt: skip
    return out
