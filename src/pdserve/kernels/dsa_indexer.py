"""The DSA indexer's scores over the paged key cache, and a sort-free top-k select.

Token ``t`` of request ``b`` at position ``pos`` scores every key ``s <= pos`` of its
request (``cache`` [blocks, block_size, D], one shared key head):

    I[t, s] = sum_h w[t, h] * ReLU(scale * q[t, h] . k[s])          (float32)

**Scores** (``_logits_kernel``; the indexer backend uses it for decode, one query row a
request: prefill and verify rows go to the query-tiled kernel of
:mod:`~pdserve.kernels.dsa_indexer_tiled`, which reads each key once for a tile of a
request's tokens): program ``(token, key range)`` keeps the token's ``n_heads x D`` query
tile and streams ``KEYS_PER_PROGRAM`` keys in ``BLOCK_N`` tiles:
gather through the block table, one ``[heads, D] x [D, BLOCK_N]`` dot, ReLU, the
weighted head sum. The result goes to a ``[T, width]`` float32 buffer (``width``: the
step's context bound, ``max_model_len`` under a CUDA graph); key ranges past ``pos``
do no work (and store -inf when the scores go to ``torch.topk``).

**Select** (``_select_kernel``): one program per token finds the ``K``-th largest score
by a most-significant-digit radix select over the float bits (mapped to order-preserving
unsigned ints): four passes of 8-bit histograms, each restricted to the keys that match
the digits fixed so far, narrow the threshold to one value; a last pass writes the
positions above it and the first ones equal to it (lowest positions win ties), -1 after.
It reads the row five times and never sorts. Rows with ``pos + 1 <= K`` keys (or whose
request's context is at most ``K``) take every causal key, and their scores are never
computed: the caller then attends densely anyway. One program per row bounds its speed
on few long rows (H200, 8 rows of 128K: 0.47 ms against 0.09 ms for ``torch.topk``'s
multi-block radix select; 16K rows: 0.06 ms against 0.08-0.10 ms), so the indexer
backend hands rows wider than ``SORT_FREE_MAX_WIDTH`` to ``torch.topk``. Rows up to
``REG_SELECT_MAX_WIDTH`` keys go to :mod:`~pdserve.kernels.dsa_select` by default (the
row held in registers, one read); this kernel stays for wider rows and as a variant.

Output: ``[T, K]`` int64 key positions (the reference returns them sorted by score; this
one in position order within the two groups: attention does not care about order).

**FP8 keys** (``--kv-cache-dtype fp8``): the cache holds float8_e4m3fn keys with one
float32 scale per key, computed as the key is written (the layout and its torch helpers:
:mod:`pdserve.kernels.index_cache`). The score kernels take the scale view as
``k_scale``: the fp8 tile is widened to the query's dtype for the dot (exact: every e4m3
value is a bf16 value) and the weighted head sum of each key is multiplied by its scale
once, ``sum_h w * ReLU(q . k_fp8 * s) = s * sum_h w * ReLU(q . k_fp8)`` since ``s > 0``.
The engine's queries stay in the model dtype; fp8 queries with their per-(token, head)
scales folded into the weights (``index_cache.quantize_index_queries``) make the dots
FP8 MMAs (a variant the benchmarks measure).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import (
    check_device,
    dot_precision,
    dot_upcast,
    next_pow2,
    num_sms,
    pdl_args,
    pdl_enter,
)
from pdserve.kernels.dsa_select import (
    REG_SELECT_MAX_WIDTH,
    radix_select_row,
    reg_topk_select,
    row_extent,
    write_every_key,
)
from pdserve.kernels.dsa_select_split import split_rows, split_topk_select
from pdserve.kernels.index_cache import check_key_cache

BLOCK_N = 64
KEYS_PER_PROGRAM = 256
SELECT_BLOCK = 4096
SELECT_VARIANTS = ("auto", "rows", "rows_bits", "rows_hist", "radix", "split")
SORT_FREE_MAX_WIDTH = 32768  # wider score rows go to torch.topk (see the module doc)


@triton.jit
def _logits_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    ks_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    req_ptr,
    qidx_ptr,
    out_ptr,
    scale,
    width,
    topk_k,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_cb,
    stride_cs,
    stride_kb,
    stride_bt,
    stride_ot,
    NH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    FILL: tl.constexpr,
    KEY_SCALE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK * ITERS
    req = tl.load(req_ptr + t)
    seq_len = tl.load(seq_lens_ptr + req)
    pos = seq_len - tl.load(qsl_ptr + req + 1) + tl.load(qsl_ptr + req) + tl.load(qidx_ptr + t)
    row_out = out_ptr + t * stride_ot
    if (start <= pos) & (seq_len > topk_k):
        offs_h = tl.arange(0, BLOCK_H)
        h_ok = offs_h < NH
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(
            q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
            mask=h_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        w = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        bt_row = bt_ptr + req.to(tl.int64) * stride_bt
        for i in tl.static_range(ITERS):
            s_pos = start + i * BLOCK + tl.arange(0, BLOCK)
            ok = s_pos <= pos
            blk = tl.load(bt_row + s_pos // PAGE, mask=ok, other=0).to(tl.int64)
            row = blk * stride_cb + (s_pos % PAGE).to(tl.int64) * stride_cs
            k = tl.load(
                cache_ptr + row[None, :] + offs_d[:, None],
                mask=ok[None, :] & d_ok[:, None],
                other=0.0,
            )  # [BLOCK_D, BLOCK]
            k = k.to(q.dtype)
            s = tl.dot(q, k, input_precision=DOT_PREC) * scale  # [BLOCK_H, BLOCK]
            idx = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
            if KEY_SCALE:  # fp8 keys: each key's scale (> 0) after the ReLU
                idx *= tl.load(ks_ptr + blk * stride_kb + s_pos % PAGE, mask=ok, other=0.0)
            tl.store(row_out + s_pos, tl.where(ok, idx, float("-inf")), mask=s_pos < width)
    elif FILL:
        offs = start + tl.arange(0, BLOCK * ITERS)
        tl.store(row_out + offs, tl.full([BLOCK * ITERS], float("-inf"), tl.float32),
                 mask=offs < width)  # fmt: skip


@triton.jit
def _select_kernel(
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
        radix_select_row(row, dst, n, K, BLOCK)


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req_idx: torch.Tensor,
    token_q_idx: torch.Tensor,
    scale: float,
    num_tokens: int,
    width: int,
    topk: int,
    for_select: bool = True,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Index scores [num_tokens, width] float32.

    ``for_select``: only what :func:`topk_select` reads is written (each row up to its
    position; rows whose request's context is at most ``topk`` not at all), saving the
    buffer's fill. Otherwise every causal score, -inf past each token's position (what
    ``torch.topk`` needs). ``k_scale`` [blocks, block_size] float32: ``cache`` holds fp8
    keys with these per-key scales (``pdserve.kernels.index_cache.indexer_cache_views``)."""
    check_device(q, "indexer_logits")
    _, nh, d = q.shape
    check_key_cache(cache, k_scale, d, q.dtype)
    if q.stride(-1) != 1:
        raise ValueError("indexer queries need unit inner stride")
    out = torch.empty(num_tokens, width, dtype=torch.float32, device=q.device)
    skip_below = topk if for_select else 0
    if num_tokens == 0 or width == 0:
        return out
    block_n, span = BLOCK_N, KEYS_PER_PROGRAM
    if num_tokens * triton.cdiv(width, 2 * span) >= 4 * num_sms(q.device):
        block_n, span = 2 * BLOCK_N, 2 * span  # enough programs: longer ones
    _logits_kernel[(num_tokens, triton.cdiv(width, span))](
        q,
        weights,
        cache,
        cache if k_scale is None else k_scale,
        block_tables,
        seq_lens,
        query_start_loc,
        token_req_idx,
        token_q_idx,
        out,
        scale,
        width,
        skip_below,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        cache.stride(0),
        cache.stride(1),
        0 if k_scale is None else k_scale.stride(0),
        block_tables.stride(0),
        out.stride(0),
        NH=nh,
        D=d,
        BLOCK_H=max(16, next_pow2(nh)),
        BLOCK_D=max(16, next_pow2(d)),
        PAGE=cache.shape[1],
        BLOCK=block_n,
        ITERS=span // block_n,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=dot_upcast(q.dtype),
        FILL=not for_select,
        KEY_SCALE=k_scale is not None,
        num_warps=4,
        **pdl_args(q.device),
    )
    return out


def topk_select(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req_idx: torch.Tensor,
    token_q_idx: torch.Tensor,
    topk: int,
    num_tokens: int,
    out: torch.Tensor | None = None,
    variant: str = "auto",
) -> torch.Tensor:
    """Positions [T, topk] int64 of each token's ``topk`` best causal scores (-1 pads).

    ``variant``: ``"rows"`` holds each row in registers
    (:func:`~pdserve.kernels.dsa_select.reg_topk_select`, rows up to
    ``REG_SELECT_MAX_WIDTH`` keys; ``"rows_bits"`` / ``"rows_hist"`` name how it finds the
    K-th key), ``"radix"`` the histogram kernel here (any width), ``"split"`` each row over
    several programs (:func:`~pdserve.kernels.dsa_select_split.split_topk_select`, any
    width), ``"auto"``: ``"split"`` up to :func:`~pdserve.kernels.dsa_select_split.split_rows`
    rows, else the first of ``"rows"``, ``"radix"`` the width allows."""
    check_device(logits, "topk_select")
    if variant not in SELECT_VARIANTS:
        raise ValueError(f"topk_select variant must be one of {SELECT_VARIANTS}, not {variant!r}")
    if variant == "auto" and num_tokens <= split_rows():
        variant = "split"
    rows = variant.startswith("rows") or (
        variant == "auto" and logits.shape[1] <= REG_SELECT_MAX_WIDTH
    )
    if out is None:  # the register and split selects write every slot of their rows
        out = torch.empty((num_tokens, topk), dtype=torch.int64, device=logits.device)
    place = (seq_lens, query_start_loc, token_req_idx, token_q_idx)
    if variant == "split":
        return split_topk_select(logits, *place, topk, num_tokens, out)
    if not rows:
        out.fill_(-1)
    if num_tokens == 0:
        return out
    if rows:
        hist = {"rows_bits": False, "rows_hist": True}.get(variant)
        return reg_topk_select(logits, *place, topk, num_tokens, out, hist=hist)
    _select_kernel[(num_tokens,)](
        logits,
        seq_lens,
        query_start_loc,
        token_req_idx,
        token_q_idx,
        out,
        logits.stride(0),
        out.stride(0),
        topk,
        BLOCK=SELECT_BLOCK,
        BLOCK_K=min(1024, next_pow2(topk)),
        num_warps=8 if SELECT_BLOCK >= 2048 else 4,
        **pdl_args(logits.device),
    )
    return out


def indexer_topk_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    req: torch.Tensor,
    scale: float,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, S] with -inf past each position, top-k positions [T, topk], -1 pads)
    with torch ops; ``keys`` [B, S, D] are the requests' contexts in position order."""
    s = torch.einsum("thd,tsd->ths", q.float(), keys[req].float()) * scale
    scores = torch.einsum("th,ths->ts", weights.float(), s.relu())
    causal = torch.arange(keys.shape[1], device=q.device)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    kk = min(topk, keys.shape[1])
    vals, idx = scores.topk(kk, dim=-1)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    out[:, :kk] = torch.where(vals > float("-inf"), idx, -1)
    return scores, out
