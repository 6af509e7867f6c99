"""Top-k select of DSA indexer score rows held in registers (prefill rows up to 32K keys).

Same contract as :func:`~pdserve.kernels.dsa_indexer.topk_select`: per token the ``K``
causal positions of its best scores, the ones equal to the K-th best taken lowest
position first, -1 pads; rows with ``pos + 1 <= K`` keys (or whose request's context is
at most ``K``) take every causal key without reading the row.

One program per row loads the row once (``BLOCK`` = the score width rounded up to a power
of two; float bits mapped to order-preserving unsigned keys, 0 outside the row) and keeps
it in registers. A threshold is found bit by bit, most significant first (each step
``count(key >= prefix | bit) >= K``: one compare and one sum over the row, no histogram,
no memory traffic); it stops as soon as exactly ``K`` keys are at or above the prefix
(distinct scores: the prefix then lies between the K-th and the next key, some 20 steps
in), else after 32 steps at the K-th key itself; a step costs about three instructions
a key of the block, padding included. Then one pass over the row (re-read from L2 in
chunks of ``REG_SELECT_CHUNK``) writes the positions: with exactly ``K`` at or above the
threshold, those in position order (one prefix sum); with ties at the K-th key, the
positions above it and then the first ones equal to it (two prefix sums). With ``HIST``
(:data:`REG_SELECT_HIST`, the ``rows_hist`` select variant) the K-th key is found a byte
at a time instead: four 256-bin histograms (``tl.histogram``) of the keys sharing the
bytes found so far, in place of up to 32 row-wide reductions. A row is processed at the
smallest of ``BLOCK``, ``BLOCK/2``, ``BLOCK/4`` that holds it (``SPLITS``), so short rows
of a wide buffer cost less; with ``TAIL`` (:data:`REG_SELECT_TAIL`) a row just past
``BLOCK/2`` (a 16K context plus what decode added, in the 32K buffer of a decode graph)
is held as a ``BLOCK/2`` tile and a ``BLOCK/TAIL`` (or ``BLOCK/4``) one, two reductions
a step over 17K keys instead of one over 32K. Rows wider than :data:`REG_SELECT_MAX_WIDTH` keep the
histogram radix kernel of :mod:`~pdserve.kernels.dsa_indexer`.

Warps: about :data:`REG_SELECT_PER_THREAD` keys a thread (8 warps at 16K, 16 at 32K).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import next_pow2, pdl_args, pdl_enter

REG_SELECT_MAX_WIDTH = 32768  # wider rows: the radix kernel (dsa_indexer)
REG_SELECT_PER_THREAD = 64  # keys a thread holds (sets num_warps, 4..16)
REG_SELECT_SPLITS = 2  # also compile BLOCK/2 .. BLOCK/2**SPLITS paths for short rows
REG_SELECT_CHUNK = 2048  # keys a step of the writing pass
REG_SELECT_HIST = False  # byte histograms: 5.49 ms against 1.36 at 16K (H100, RESULTS.md run 58)
# rows just past half the block as two tiles (BLOCK/2 and BLOCK/TAIL or BLOCK/4 keys):
# 0, off, until measured; PDSERVE_SELECT_TAIL=16 turns it on
REG_SELECT_TAIL = 0
SELECT_TAIL_ENV = "PDSERVE_SELECT_TAIL"


@triton.jit
def row_extent(seq_lens_ptr, qsl_ptr, req_ptr, qidx_ptr, t):
    """(token ``t``'s request context length, its causal keys ``n = pos + 1``)."""
    req = tl.load(req_ptr + t)
    seq_len = tl.load(seq_lens_ptr + req)
    pos = seq_len - tl.load(qsl_ptr + req + 1) + tl.load(qsl_ptr + req) + tl.load(qidx_ptr + t)
    return seq_len, pos + 1


@triton.jit
def write_every_key(dst, n, K, BLOCK_K: tl.constexpr):
    """A row within top-k: positions ``0 .. n-1`` in ``dst[0:K]``, -1 after."""
    for k0 in range(0, K, BLOCK_K):
        j = k0 + tl.arange(0, BLOCK_K)
        tl.store(dst + j, tl.where(j < n, j, -1).to(tl.int64), mask=j < K)


@triton.jit
def write_none(dst, K, BLOCK_K: tl.constexpr):
    """-1 in every slot of ``dst[0:K]``."""
    for k0 in range(0, K, BLOCK_K):
        j = k0 + tl.arange(0, BLOCK_K)
        tl.store(dst + j, tl.full([BLOCK_K], -1, tl.int64), mask=j < K)


@triton.jit
def _keys_of(scores):
    """float32 scores as unsigned keys of the same order."""
    bits = scores.to(tl.int32, bitcast=True)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed ints
    return (bits ^ (-2147483648)).to(tl.uint32, bitcast=True)  # ... as unsigned ints


@triton.jit
def _kth_key_bits(key, K, BLOCK: tl.constexpr):
    """(a key ``thr``, ``count(key >= thr)``): bit by bit, most significant first, one
    reduction a bit. It stops as soon as ``count(key >= thr) == K`` (the keys at or above
    ``thr`` are then exactly the top ``K``: the search need not pin down the K-th key
    itself), else after 32 bits with ``thr`` the K-th key (ties at it: the count is
    above ``K``)."""
    # count(key >= 0): every key of the block
    return _kth_key_bits_from(key, K, tl.zeros([], tl.uint32), tl.full([], BLOCK, tl.int32),
                              tl.zeros([], tl.int32))  # fmt: skip


@triton.jit
def _kth_key_bits_from(key, K, thr, cnt_thr, b):
    """:func:`_kth_key_bits` from bit ``b`` on: ``thr`` holds the bits above it (every
    key that matters shares them) and ``cnt_thr`` is ``count(key >= thr) >= K``."""
    top = tl.full([], 2147483648, tl.uint32)
    while (b < 32) & (cnt_thr != K):  # the largest thr with count(key >= thr) >= K
        cand = thr | (top >> b.to(tl.uint32))
        cnt = tl.sum((key >= cand).to(tl.int32))
        thr = tl.where(cnt >= K, cand, thr)
        cnt_thr = tl.where(cnt >= K, cnt, cnt_thr)
        b += 1
    return thr, cnt_thr


@triton.jit
def _kth_key_hist(key, K):
    """(the K-th largest of ``key``, ``count(key >= it)``): a byte at a time, most
    significant first, from a 256-bin histogram of the keys that share the bytes found
    so far (4 histograms instead of 32 reductions). The padding keys (0) are counted
    too: they are below every real key and ``K`` is below the row's length."""
    bins = tl.arange(0, 256)
    thr = tl.zeros([], tl.uint32)
    need = K  # keys still to take among those matching thr's bytes so far
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # a constexpr per unrolled step (no annotation: it is reassigned)
        digit = ((key >> shift) & 0xFF).to(tl.int32)
        if p == 0:  # a shift by 32 is undefined: every key matches the empty prefix
            hist = tl.histogram(digit, 256)
        else:
            hist = tl.histogram(digit, 256, mask=(key >> (shift + 8)) == (thr >> (shift + 8)))
        ge = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # matching keys with byte >= bin
        d = tl.max(tl.where(ge >= need, bins, -1))  # the K-th key's byte
        need -= tl.sum(tl.where(bins > d, hist, 0))
        thr = thr | (d.to(tl.uint32) << shift)
    return thr, K - need + tl.sum((key == thr).to(tl.int32))


@triton.jit
def _write_top(row, dst, n, thr, CHUNK: tl.constexpr):
    """Write the positions of ``row[0:n]``'s keys at or above ``thr`` (exactly the top K)
    to ``dst`` in position order: one prefix sum a chunk, re-read from L2 (a prefix sum
    over the whole row in registers would double the registers a key needs)."""
    n_in = tl.zeros([], tl.int32)
    for c0 in range(0, n, CHUNK):
        s = c0 + tl.arange(0, CHUNK)
        ok = s < n
        take = ok & (_keys_of(tl.load(row + s, mask=ok, other=0.0)) >= thr)
        rank = n_in + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(dst + rank, s.to(tl.int64), mask=take)
        n_in += tl.sum(take.to(tl.int32))


@triton.jit
def _write_ties(row, dst, n, K, thr, above, CHUNK: tl.constexpr):
    """Ties at the K-th key ``thr``: every key above it (``above`` of them), then the
    first ``K - above`` equal to it, in position order within each group."""
    n_gt = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for c0 in range(0, n, CHUNK):
        s = c0 + tl.arange(0, CHUNK)
        ok = s < n
        ck = _keys_of(tl.load(row + s, mask=ok, other=0.0))
        gt = ok & (ck > thr)
        eq = ok & (ck == thr)
        gt_rank = n_gt + tl.cumsum(gt.to(tl.int32), 0) - 1
        eq_rank = n_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        take_eq = eq & (eq_rank < K - above)
        slot = tl.where(gt, gt_rank, above + eq_rank)
        tl.store(dst + slot, s.to(tl.int64), mask=gt | take_eq)
        n_gt += tl.sum(gt.to(tl.int32))
        n_eq += tl.sum(eq.to(tl.int32))


@triton.jit
def _select_row(row, dst, n, K, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                HIST: tl.constexpr = False):  # fmt: skip
    """Write the top-``K`` positions of ``row[0:n]`` (``K < n <= BLOCK``) to ``dst``."""
    offs = tl.arange(0, BLOCK)
    in_row = offs < n
    key = _keys_of(tl.load(row + offs, mask=in_row, other=0.0))
    key = tl.where(in_row, key, tl.zeros_like(key))  # below every real score's key
    if HIST:
        thr, n_ge = _kth_key_hist(key, K)
    else:
        thr, n_ge = _kth_key_bits(key, K, BLOCK)
    if n_ge == K:  # the keys >= thr are the top K
        _write_top(row, dst, n, thr, CHUNK)
    else:
        _write_ties(row, dst, n, K, thr, tl.sum((key > thr).to(tl.int32)), CHUNK)


@triton.jit
def _select_row2(row, dst, n, K, BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                 CHUNK: tl.constexpr):  # fmt: skip
    """:func:`_select_row` for ``BLOCK < n <= BLOCK + TAIL_BLOCK``: the first ``BLOCK``
    keys in one tile and the rest in a ``TAIL_BLOCK`` one, so a row just past a power of
    two is not held (and every step of the search not reduced) at twice its width."""
    key = _keys_of(tl.load(row + tl.arange(0, BLOCK)))
    toffs = BLOCK + tl.arange(0, TAIL_BLOCK)
    in_row = toffs < n
    tail = _keys_of(tl.load(row + toffs, mask=in_row, other=0.0))
    tail = tl.where(in_row, tail, tl.zeros_like(tail))
    thr = tl.zeros([], tl.uint32)
    cnt_thr = tl.full([], BLOCK + TAIL_BLOCK, tl.int32)
    top = tl.full([], 2147483648, tl.uint32)
    b = tl.zeros([], tl.int32)
    while (b < 32) & (cnt_thr != K):  # as _kth_key_bits, over both tiles
        cand = thr | (top >> b.to(tl.uint32))
        cnt = tl.sum((key >= cand).to(tl.int32)) + tl.sum((tail >= cand).to(tl.int32))
        thr = tl.where(cnt >= K, cand, thr)
        cnt_thr = tl.where(cnt >= K, cnt, cnt_thr)
        b += 1
    if cnt_thr == K:
        _write_top(row, dst, n, thr, CHUNK)
    else:
        above = tl.sum((key > thr).to(tl.int32)) + tl.sum((tail > thr).to(tl.int32))
        _write_ties(row, dst, n, K, thr, above, CHUNK)


@triton.jit
def _select_wide(row, dst, n, K, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                 HIST: tl.constexpr, TAIL: tl.constexpr):  # fmt: skip
    """A row of ``BLOCK / 2 < n <= BLOCK`` keys: with ``TAIL`` (and bits, not histograms)
    one just past ``BLOCK / 2`` as two tiles, ``BLOCK / 2`` and ``BLOCK / TAIL`` or
    ``BLOCK / 4`` keys (:func:`_select_row2`); else one ``BLOCK`` tile."""
    if TAIL > 0 and not HIST:
        if n <= BLOCK // 2 + BLOCK // TAIL:
            _select_row2(row, dst, n, K, BLOCK // 2, BLOCK // TAIL, CHUNK)
        elif n <= BLOCK // 2 + BLOCK // 4:
            _select_row2(row, dst, n, K, BLOCK // 2, BLOCK // 4, CHUNK)
        else:
            _select_row(row, dst, n, K, BLOCK, CHUNK, HIST)
    else:
        _select_row(row, dst, n, K, BLOCK, CHUNK, HIST)


@triton.jit
def radix_select_row(row, dst, n, K, BLOCK: tl.constexpr):
    """Write the top-``K`` positions of ``row[0:n]`` (``K < n``, any ``n``) to ``dst``: a
    most-significant-digit radix select over memory, ``BLOCK`` keys a step (the
    histogram select of :mod:`~pdserve.kernels.dsa_indexer`)."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.uint32)
    pmask = tl.zeros([], tl.uint32)
    remaining = K
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for n0 in range(0, n, BLOCK):
            s = n0 + offs
            # float bits -> uint32 in float order (helpers are inlined: the
            # interpreter re-patches triton.language on every device-function call)
            bits = tl.load(row + s, mask=s < n, other=0.0).to(tl.int32, bitcast=True)
            bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)
            key = (bits ^ (-2147483648)).to(tl.uint32, bitcast=True)
            match = (s < n) & ((key & pmask) == prefix)
            digit = ((key >> shift) & 255).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=match)
        ge = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # keys with digit >= bin
        d = tl.max(tl.where(ge >= remaining, bins, -1))
        remaining -= tl.sum(tl.where(bins > d, hist, 0))
        prefix = prefix | (d.to(tl.uint32) << shift)
        pmask = pmask | (tl.full([], 255, tl.uint32) << shift)
    # keys strictly above the threshold (K - remaining of them) all taken, then ties
    _write_ties(row, dst, n, K, prefix, K - remaining, BLOCK)


@triton.jit
def _reg_select_kernel(
    logits_ptr,
    seq_lens_ptr,
    qsl_ptr,
    req_ptr,
    qidx_ptr,
    out_ptr,
    stride_lt,
    stride_ot,
    K,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
    HIST: tl.constexpr = False,
    TAIL: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    seq_len, n = row_extent(seq_lens_ptr, qsl_ptr, req_ptr, qidx_ptr, t)
    row = logits_ptr + t * stride_lt
    dst = out_ptr + t * stride_ot
    if (n <= K) | (seq_len <= K):
        write_every_key(dst, n, K, BLOCK_K)
    else:
        # -1 first: a row whose scores cannot be ordered (NaN) keeps no stale slot
        write_none(dst, K, BLOCK_K)
        tl.debug_barrier()  # the -1s land before the row's positions overwrite them
        if SPLITS >= 2:
            if n <= BLOCK // 4:
                _select_row(row, dst, n, K, BLOCK // 4, CHUNK, HIST)
            elif n <= BLOCK // 2:
                _select_row(row, dst, n, K, BLOCK // 2, CHUNK, HIST)
            else:
                _select_wide(row, dst, n, K, BLOCK, CHUNK, HIST, TAIL)
        elif SPLITS == 1:
            if n <= BLOCK // 2:
                _select_row(row, dst, n, K, BLOCK // 2, CHUNK, HIST)
            else:
                _select_wide(row, dst, n, K, BLOCK, CHUNK, HIST, TAIL)
        else:
            _select_row(row, dst, n, K, BLOCK, CHUNK, HIST)


def reg_select_warps(width: int) -> int:
    return max(4, min(16, next_pow2(width) // (32 * REG_SELECT_PER_THREAD)))


def reg_topk_select(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req_idx: torch.Tensor,
    token_q_idx: torch.Tensor,
    topk: int,
    num_tokens: int,
    out: torch.Tensor,
    splits: int = REG_SELECT_SPLITS,
    num_warps: int | None = None,
    hist: bool | None = None,
    tail: int | None = None,
) -> torch.Tensor:
    """Fill ``out`` [num_tokens, topk] (every slot of those rows is written; -1 pads) from
    score rows of width up to :data:`REG_SELECT_MAX_WIDTH`. ``hist``: find the K-th key
    by byte histograms instead of bit by bit (default :data:`REG_SELECT_HIST`). ``tail``:
    a row just past half the block as two tiles (:func:`_select_wide`; a power of two >=
    4, 0 off; default ``PDSERVE_SELECT_TAIL``, else :data:`REG_SELECT_TAIL`)."""
    width = logits.shape[1]
    if width > REG_SELECT_MAX_WIDTH:
        raise ValueError(f"register select holds rows up to {REG_SELECT_MAX_WIDTH} keys: {width}")
    block = max(16, next_pow2(width))
    if tail is None:
        env = os.environ.get(SELECT_TAIL_ENV)
        if env is not None and not env.isdigit():
            raise ValueError(f"{SELECT_TAIL_ENV} must be 0 or a power of two >= 4 (got {env!r})")
        tail = REG_SELECT_TAIL if env is None else int(env)
    if tail and (tail < 4 or tail & (tail - 1)):
        raise ValueError(f"select tail must be 0 or a power of two >= 4 (got {tail})")
    if block // max(tail, 1) < 16:
        tail = 0  # the tail tile would be under 16 keys
    _reg_select_kernel[(num_tokens,)](
        logits,
        seq_lens,
        query_start_loc,
        token_req_idx,
        token_q_idx,
        out,
        logits.stride(0),
        out.stride(0),
        topk,
        BLOCK=block,
        BLOCK_K=min(1024, next_pow2(topk)),
        SPLITS=min(splits, max(0, block.bit_length() - 5)),  # keep BLOCK >> SPLITS >= 16
        CHUNK=min(block, REG_SELECT_CHUNK),
        HIST=REG_SELECT_HIST if hist is None else hist,
        TAIL=tail,
        num_warps=num_warps or reg_select_warps(width),
        **pdl_args(logits.device),
    )
    return out
