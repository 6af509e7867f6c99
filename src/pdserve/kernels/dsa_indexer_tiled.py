"""The DSA indexer's scores for query tiles: every query token of a tile shares one pass
over its request's keys (prefill chunks, MTP verify rows).

Same scores as :func:`~pdserve.kernels.dsa_indexer.indexer_logits` (token ``t`` at
position ``pos`` of request ``b``; keys ``k[s]`` from the paged cache, one shared head):

    I[t, s] = sum_h w[t, h] * ReLU(scale * q[t, h] . k[s])          (float32)

computed as ``sum_h (scale * w[t, h]) * ReLU(q[t, h] . k[s])`` (``scale > 0``). The
per-token kernel gathers every key once per query token; here program ``(key range,
tile, request)`` takes ``BT`` consecutive query tokens of the request, reads each key of
the range once for all of them (through the block table), and applies each token's causal
mask. Key ranges vary fastest in launch order, so the programs resident at once work on a
few query tiles, whose reloads (below) stay in L2. Programs past the request's query
rows, or whose key range starts past the tile's last position, do no work. Two
formulations (:class:`TileConfig` ``variant``):

``rows``   one ``[BT * heads, D] x [D, BN]`` dot per key block (the tile's queries stay
           in registers/shared memory for the whole range), ReLU, the per-row weight, and
           a sum over each token's heads (a reshape). ``BT * heads`` rows fill the MMA even
           for a few tokens: the verify shape (1+k rows per request).
``heads``  ``BT`` tokens as the MMA's rows; per key block a loop over heads,
           ``acc += ReLU(Q_h K^T) * w[:, h]`` with ``Q_h`` ([BT, D]) reloaded per head
           (from L2). No reshape; it needs ``BT >= 16`` tokens: prefill.
``keys``   ``rows`` transposed: the key block is the MMA's rows, ``[BN, D] x [D, BT *
           heads]``, so a token's heads are accumulator columns. In ``rows`` a token's
           heads are rows that span two warps, so the head sum crosses warps (shared
           memory and a barrier every key block); as columns they lie in one thread's
           registers and its quad's lanes. ``BN`` must be 64 keys a warpgroup (wgmma).

The grid comes from host ints only (``num_reqs``, the step's ``max_query_len``, the score
width), so a CUDA graph of verify steps (fixed ``1+k`` rows) captures one launch. One
launch serves the requests whose query length lies in ``(min_q, max_q]``:
:func:`indexer_logits_tiled` sends requests of at most ``SMALL_QUERY_ROWS`` rows (verify
rows; decode rows of a mixed step) to the ``rows`` launch and longer ones to the prefill
launch, so a one-row request never occupies a 64-token tile.

Launch configs are module constants (:data:`PREFILL_TILE`, :data:`VERIFY_TILE`), from the
H200 sweep (``benchmarks/glm5_kernels_bench.py --sections indexer_prefill,indexer_verify``;
132 SMs, 228 KB shared memory an SM, wgmma: 64 rows a warpgroup):

* prefill ``heads``, BT=64, BN=128, 4 warps, 2 stages: one 64-row wgmma tile a head
  (one warpgroup: 8 warps splitting the 128 keys were 10-35% slower at 16K-64K);
  ``Q_h`` tiles double-buffered with cp.async.
  ``Q_h`` reloads cost BN FLOP a byte of L2 traffic (128: ~4 TB/s at 500 TFLOP/s; BN=256
  halves it but needs ~250 registers with 8 warps: one program an SM). SPAN 1024 keys a
  program (16K prefill: ~2.2K live programs, 8 waves).
* verify ``rows``, BT = the rows a request (rounded up to a power of two, at most 8),
  BN=64, 8 warps, 3 stages: at 1+3 rows 128 MMA rows; the reshape to [BT, heads, BN]
  is a register relabelling (no shared-memory round trip), the head sum shuffles within
  warps. A 16K context is 4 MB of keys a request; key tiles stream through cp.async
  stages.

FP8 keys (``k_scale`` given: :func:`~pdserve.kernels.index_cache.indexer_cache_views`):
each fp8 key tile is widened to the query dtype for the dot and each key's score (after
the ReLU and the head sum) is multiplied by its scale, once a key block.

``span`` is the most keys a program covers: the launcher halves it (not below ``bn``)
while the estimated number of live programs is under two waves of the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
from pdserve.kernels.index_cache import check_key_cache


@dataclass(frozen=True)
class TileConfig:
    variant: str  # "rows" | "heads" | "keys" (see the module doc)
    bt: int  # query tokens a tile ("rows": the most; a launch uses next_pow2(rows) up to it)
    bn: int  # keys a block (one dot)
    span: int  # keys a program (at most; see the module doc)
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.variant not in ("rows", "heads", "keys"):
            raise ValueError(
                f"TileConfig.variant must be 'rows', 'heads' or 'keys', not {self.variant!r}"
            )
        for name in ("bt", "bn", "span"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two, got {v}")
        if self.span < self.bn:
            raise ValueError(f"TileConfig.span {self.span} < bn {self.bn}")


# H200 sweep of 2026-12-05 (RESULTS.md run 41, 32 index heads x 128): prefill 16K 3.06 ->
# 2.79 ms and 64K 65.9 -> 43.3 ms with 4 warps instead of 8; verify 128 x 4 rows at 16K
# 0.370 -> 0.308 ms with 8 warps instead of 4 (128 keys a tile with 4 warps: 0.305 ms, but
# it spills registers)
PREFILL_TILE = TileConfig("heads", bt=64, bn=128, span=1024, num_warps=4, num_stages=2)
VERIFY_TILE = TileConfig("rows", bt=8, bn=64, span=1024, num_warps=8, num_stages=3)
SMALL_QUERY_ROWS = 8  # requests with at most this many query rows go to VERIFY_TILE


@triton.jit
def _tiled_logits_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    ks_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    tok_lo,
    tok_hi,
    min_q,
    max_q,
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
    BT: tl.constexpr,
    BN: tl.constexpr,
    SPAN: tl.constexpr,
    HEAD_LOOP: tl.constexpr,
    KEYS_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    FILL: tl.constexpr,
    KEY_SCALE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    req = tl.program_id(2)
    q0 = tl.load(qsl_ptr + req)
    q1 = tl.load(qsl_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    q_len = q1 - q0
    t0 = tl.maximum(q0, tok_lo) + tl.program_id(1) * BT  # first token of the tile
    n_t = tl.minimum(tl.minimum(q1, tok_hi) - t0, BT)  # its tokens (<= 0: none)
    first_pos = seq_len - q1 + t0  # position of token t0 in its request
    last_pos = first_pos + n_t - 1
    start = tl.program_id(0) * SPAN  # key ranges vary fastest: a tile's run together
    live = (n_t > 0) & (q_len > min_q) & (q_len <= max_q)
    # for the select (topk_k > 0): rows with pos + 1 <= topk_k take every key unread
    scored = live & (start <= last_pos) & (seq_len > topk_k) & (last_pos >= topk_k)
    kend = tl.minimum(start + SPAN, last_pos + 1)  # keys past it: masked for every token
    offs_t = tl.arange(0, BT)
    t_ok = offs_t < n_t
    pos_t = first_pos + offs_t
    out_rows = out_ptr + (t0 - tok_lo + offs_t).to(tl.int64) * stride_ot  # [BT]
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if scored:
        bt_row = bt_ptr + req.to(tl.int64) * stride_bt
        if HEAD_LOOP:
            tok_t = (t0 + offs_t).to(tl.int64)
            for s0 in range(start, kend, BN):
                s_pos = s0 + tl.arange(0, BN)
                ok = s_pos < kend
                blk = tl.load(bt_row + s_pos // PAGE, mask=ok, other=0).to(tl.int64)
                krow = blk * stride_cb + (s_pos % PAGE).to(tl.int64) * stride_cs
                k = tl.load(
                    cache_ptr + krow[None, :] + offs_d[:, None],
                    mask=ok[None, :] & d_ok[:, None],
                    other=0.0,
                )  # [BLOCK_D, BN]
                if UPCAST:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
                    k = k.to(tl.float32)
                else:
                    k = k.to(q_ptr.dtype.element_ty)
                acc = tl.zeros([BT, BN], tl.float32)
                for h in range(NH):
                    qh = tl.load(
                        q_ptr + tok_t[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                        mask=t_ok[:, None] & d_ok[None, :],
                        other=0.0,
                    )  # [BT, BLOCK_D]
                    if UPCAST:
                        qh = qh.to(tl.float32)
                    wh = tl.load(w_ptr + tok_t * stride_wt + h, mask=t_ok, other=0.0) * scale
                    s = tl.dot(qh, k, input_precision=DOT_PREC)
                    acc += tl.maximum(s, 0.0) * wh[:, None]
                if KEY_SCALE:  # fp8 keys: each key's scale (> 0), once for every head
                    ks = tl.load(ks_ptr + blk * stride_kb + s_pos % PAGE, mask=ok, other=0.0)
                    acc *= ks[None, :]
                causal = s_pos[None, :] <= pos_t[:, None]
                tl.store(
                    out_rows[:, None] + s_pos[None, :],
                    tl.where(causal, acc, float("-inf")),
                    mask=t_ok[:, None] & (s_pos < width)[None, :],
                )
        else:
            offs_m = tl.arange(0, BT * BLOCK_H)
            mt = offs_m // BLOCK_H
            mh = offs_m % BLOCK_H
            m_ok = (mt < n_t) & (mh < NH)
            tok_m = (t0 + mt).to(tl.int64)
            q = tl.load(
                q_ptr + tok_m[:, None] * stride_qt + mh[:, None] * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [BT * BLOCK_H, BLOCK_D]: token-major rows
            if UPCAST:
                q = q.to(tl.float32)
            w = tl.load(w_ptr + tok_m * stride_wt + mh, mask=m_ok, other=0.0) * scale
            if KEYS_M:
                qt = tl.trans(q)  # [BLOCK_D, BT * BLOCK_H]: the MMA's columns
            for s0 in range(start, kend, BN):
                s_pos = s0 + tl.arange(0, BN)
                ok = s_pos < kend
                blk = tl.load(bt_row + s_pos // PAGE, mask=ok, other=0).to(tl.int64)
                krow = blk * stride_cb + (s_pos % PAGE).to(tl.int64) * stride_cs
                if KEYS_M:
                    kk = tl.load(
                        cache_ptr + krow[:, None] + offs_d[None, :],
                        mask=ok[:, None] & d_ok[None, :],
                        other=0.0,
                    )  # [BN, BLOCK_D]
                    st = tl.dot(kk.to(q.dtype), qt, input_precision=DOT_PREC)  # [BN, BT*BH]
                    rt = tl.maximum(st, 0.0) * w[None, :]
                    idx_t = tl.sum(tl.reshape(rt, (BN, BT, BLOCK_H)), axis=2)  # [BN, BT]
                    if KEY_SCALE:  # fp8 keys: each key's scale (> 0) after the ReLU
                        ks = tl.load(ks_ptr + blk * stride_kb + s_pos % PAGE, mask=ok, other=0.0)
                        idx_t *= ks[:, None]
                    causal_t = s_pos[:, None] <= pos_t[None, :]
                    tl.store(
                        out_rows[None, :] + s_pos[:, None],
                        tl.where(causal_t, idx_t, float("-inf")),
                        mask=t_ok[None, :] & (s_pos < width)[:, None],
                    )
                else:
                    k = tl.load(
                        cache_ptr + krow[None, :] + offs_d[:, None],
                        mask=ok[None, :] & d_ok[:, None],
                        other=0.0,
                    )  # [BLOCK_D, BN]
                    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PREC)  # [BT*BH, BN]
                    r = tl.maximum(s, 0.0) * w[:, None]
                    idx = tl.sum(tl.reshape(r, (BT, BLOCK_H, BN)), axis=1)  # [BT, BN]
                    if KEY_SCALE:  # fp8 keys: each key's scale (> 0) after the ReLU
                        ks = tl.load(ks_ptr + blk * stride_kb + s_pos % PAGE, mask=ok, other=0.0)
                        idx *= ks[None, :]
                    causal = s_pos[None, :] <= pos_t[:, None]
                    tl.store(
                        out_rows[:, None] + s_pos[None, :],
                        tl.where(causal, idx, float("-inf")),
                        mask=t_ok[:, None] & (s_pos < width)[None, :],
                    )
    if FILL:  # noqa: SIM102 (constexpr, then runtime): -inf over the rest of the range
        if live:
            fill_from = tl.where(scored, start + tl.cdiv(kend - start, BN) * BN, start)
            for s0 in range(fill_from, start + SPAN, BN):
                s_pos = s0 + tl.arange(0, BN)
                tl.store(
                    out_rows[:, None] + s_pos[None, :],
                    tl.full([BT, BN], float("-inf"), tl.float32),
                    mask=t_ok[:, None] & (s_pos < width)[None, :],
                )


def tile_grid(
    cfg: TileConfig,
    nh: int,
    rows: int,
    num_reqs: int,
    width: int,
    device: torch.device,
    auto_span: bool = True,
) -> tuple[int, int, tuple[int, int, int]]:
    """(tokens a tile, keys a program, grid) of a launch of ``cfg`` over ``num_reqs``
    requests of up to ``rows`` query rows and a score width ``width`` (host ints only)."""
    block_h = next_pow2(nh)
    bt = cfg.bt
    if cfg.variant in ("rows", "keys"):
        bt = max(min(cfg.bt, next_pow2(rows)), -(-16 // block_h))  # >= 16 MMA rows / cols
    elif bt < 16:
        raise ValueError(f"heads tile of {bt} tokens < 16 MMA rows")
    tiles = triton.cdiv(rows, bt)
    span = cfg.span
    if auto_span:  # enough live programs (about half the tile x range grid is causal)
        while span > cfg.bn and num_reqs * tiles * triton.cdiv(width, span) < 4 * num_sms(device):
            span //= 2
    # key ranges fastest, then tiles: the programs running at once share a few query
    # tiles (each re-read from L2 once a key block) instead of holding one tile each
    grid = (triton.cdiv(width, span), tiles, num_reqs)
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"indexer tile grid {grid} exceeds 65535 programs on an axis")
    return bt, span, grid


def _launch(
    cfg: TileConfig,
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    num_reqs: int,
    rows: int,
    tok_lo: int,
    tok_hi: int,
    min_q: int,
    max_q: int,
    scale: float,
    width: int,
    skip_below: int,
    fill: bool,
    auto_span: bool,
    k_scale: torch.Tensor | None,
) -> None:
    """One launch over the requests with ``min_q < q_len <= max_q``; ``rows``: the most
    query rows any of them has in ``[tok_lo, tok_hi)``."""
    _, nh, d = q.shape
    bt, span, grid = tile_grid(cfg, nh, rows, num_reqs, width, q.device, auto_span)
    _tiled_logits_kernel[grid](
        q,
        weights,
        cache,
        cache if k_scale is None else k_scale,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        tok_lo,
        tok_hi,
        min_q,
        max_q,
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
        BLOCK_H=next_pow2(nh),
        BLOCK_D=max(16, next_pow2(d)),
        PAGE=cache.shape[1],
        BT=bt,
        BN=cfg.bn,
        SPAN=span,
        HEAD_LOOP=cfg.variant == "heads",
        KEYS_M=cfg.variant == "keys",
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=dot_upcast(q.dtype),
        FILL=fill,
        KEY_SCALE=k_scale is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_args(q.device),
    )


def verify_config(rows: int, nh: int, cfg: TileConfig | None = None) -> TileConfig:
    """The config of the launch for requests of up to ``rows`` query rows: ``cfg`` as
    given, else :data:`VERIFY_TILE` (with 8 warps when its tile has over 128 MMA rows)."""
    if cfg is not None:
        return cfg
    bt = min(VERIFY_TILE.bt, next_pow2(rows))
    if bt * next_pow2(nh) > 128 and VERIFY_TILE.num_warps < 8:
        return replace(VERIFY_TILE, num_warps=8)
    return VERIFY_TILE


def indexer_logits_tiled(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    max_query_len: int,
    tok_lo: int,
    tok_hi: int,
    scale: float,
    width: int,
    topk: int,
    for_select: bool = True,
    uniform: bool = False,
    prefill: TileConfig | None = None,
    verify: TileConfig | None = None,
    auto_span: bool = True,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Index scores of tokens ``tok_lo..tok_hi`` of the step ([tok_hi - tok_lo, width]
    float32; ``q`` [T, heads, D] and ``weights`` [T, heads] are the whole step's).

    ``for_select`` as :func:`~pdserve.kernels.dsa_indexer.indexer_logits`: only what the
    select reads (rows up to their position; rows whose request's context is at most
    ``topk`` not at all, nor tiles whose rows all have ``pos + 1 <= topk``); otherwise
    every score, -inf past each position. ``uniform``:
    every request has ``max_query_len`` rows (a host fact: then only one launch runs).
    ``prefill`` / ``verify``: configs other than the module's (benchmarks). ``k_scale``:
    fp8 keys with per-key scales, as :func:`~pdserve.kernels.dsa_indexer.indexer_logits`."""
    check_device(q, "indexer_logits_tiled")
    _, nh, d = q.shape
    check_key_cache(cache, k_scale, d, q.dtype)
    if q.stride(-1) != 1:
        raise ValueError("indexer queries need unit inner stride")
    if not scale > 0:
        raise ValueError(f"indexer scale must be positive (folded into the weights): {scale}")
    n = tok_hi - tok_lo
    out = torch.empty(n, width, dtype=torch.float32, device=q.device)
    if n <= 0 or width == 0 or num_reqs == 0:
        return out
    rows = min(max_query_len, n)
    common = (q, weights, cache, block_tables, seq_lens, query_start_loc, out, num_reqs)
    tail = (scale, width, topk if for_select else 0, not for_select, auto_span, k_scale)
    small = min(rows, SMALL_QUERY_ROWS)
    if not (uniform and max_query_len > SMALL_QUERY_ROWS):  # requests of <= SMALL rows
        cfg = verify_config(small, nh, verify)
        _launch(cfg, *common, small, tok_lo, tok_hi, 0, SMALL_QUERY_ROWS, *tail)
    if max_query_len > SMALL_QUERY_ROWS:  # longer ones
        cfg = prefill or PREFILL_TILE
        _launch(cfg, *common, rows, tok_lo, tok_hi, SMALL_QUERY_ROWS, max_query_len, *tail)
    return out
