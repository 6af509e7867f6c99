"""Absorbed MLA attention over the paged latent cache, sparse (DSA top-k) or dense.

Cache: ``[blocks, block_size, L + R]`` per layer: the normalised KV latent (``L`` =
``kv_lora_rank``) then the rotated shared key (``R`` = ``qk_rope_head_dim``), in the
model dtype or float8_e4m3fn (tiles are converted to the query dtype; the caller folds an
fp8 cache's per-layer scale in: ``scale`` times it, the output times it). Queries come
absorbed: ``q_lat`` [T, H, L] (``q_nope`` through ``W_UK``) and ``q_pe`` [T, H, R].
Token ``t`` of request ``b`` sits at position ``pos = seq_lens[b] - q_len[b] + q_idx[t]``
and scores key ``s`` as ``q_lat . c[s] + q_pe . k_pe[s]`` (times the scale); the values
are the latents, so the output is ``[T, H, L]`` (``W_UV`` is applied by the caller).

Candidate keys per token:

- **sparse**: the token's row of ``topk`` [T, K] (positions inside the request, -1 for
  none), used when the request's context is longer than ``K``;
- **dense**: positions ``0 .. pos``, used without ``topk`` or when ``seq_lens[b] <= K``
  (then the indexer's selection is every causal key anyway, so its indices are not read).

The choice is made per token in the kernel from ``seq_lens``, so one launch serves
decode (1 row per request), speculative verify (1+k rows) and prefill chunks, and a CUDA
graph captured at any context stays right at every other.

Work split: program ``(token, head block, split)`` loads ``BLOCK_H`` heads' queries
(the latent keys are shared by all heads, so each gathered cache row serves the whole
head block) and streams its share of the candidates: gather ``BLOCK_N`` positions,
map them through the block table, load their latent and rope parts, online softmax in
float32. With ``num_splits > 1`` each split stores its normalised partial output and
log-sum-exp and a second kernel combines them. ``num_splits`` comes from host ints only
(:func:`choose_splits`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import (
    LOG2E,
    check_device,
    dot_precision,
    dot_upcast,
    next_pow2,
    pdl_args,
    pdl_enter,
)
from pdserve.kernels.decode_attention import _reduce_kernel

MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 128
CTAS_PER_SM = 4


class MlaConfig(NamedTuple):
    """Launch shape: heads per program, candidate keys per tile, warps, pipeline stages."""

    block_h: int
    block_n: int
    warps: int
    stages: int


# At kv_lora_rank 512, from H200 sweeps (64 heads, top-k 2048): each gathered cache row
# serves the whole head block, so the more heads a program holds the fewer times a row
# is gathered. WIDE holds 64 heads (every head of a GLM-5 / DeepSeek-V3.2 token at TP1)
# in one 64-row MMA tile: its [64, 512] float32 accumulator needs two warpgroups.
CONFIG_FEW_TOKENS = MlaConfig(16, 64, 8, 2)  # up to FEW_TOKENS query rows: more programs
CONFIG_MANY_TOKENS = MlaConfig(32, 32, 4, 3)
CONFIG_WIDE = MlaConfig(64, 32, 8, 3)  # WIDE_MIN_TOKENS+ rows of 64+ heads (prefill, verify)
CONFIG_SMALL = MlaConfig(16, 32, 4, 2)  # narrow latents (tests, toy models)
# PREFILL_MIN_TOKENS+ rows of 64+ heads: 64-key tiles, 2 stages (H200 sweep of 2026-12-05,
# RESULTS.md run 41: prefill 16K 33.5 -> 31.6 ms a layer, 2K 1.88 -> 1.60; verify at 256
# x 4 rows equal, fewer rows better with CONFIG_WIDE)
CONFIG_PREFILL = MlaConfig(64, 64, 8, 2)
FEW_TOKENS = 4
WIDE_MIN_TOKENS = 64
PREFILL_MIN_TOKENS = 1024
WIDE_CTAS_PER_SM = 1  # a WIDE program takes most of a multiprocessor's shared memory


def _config(num_tokens: int, num_heads: int, block_l: int) -> MlaConfig:
    if block_l < 256:
        return CONFIG_SMALL
    if num_tokens <= FEW_TOKENS:
        return CONFIG_FEW_TOKENS
    if num_heads >= CONFIG_WIDE.block_h and num_tokens >= PREFILL_MIN_TOKENS:
        return CONFIG_PREFILL
    if num_heads >= CONFIG_WIDE.block_h and num_tokens >= WIDE_MIN_TOKENS:
        return CONFIG_WIDE
    return CONFIG_MANY_TOKENS


@triton.jit
def softmax_step(s, m_i, l_i, acc):
    """One tile of the online softmax (base 2): scores ``s`` [rows, keys] (-inf where
    masked) against the running maximum ``m_i`` and sum ``l_i`` [rows]; returns the
    tile's probabilities and the new maximum, sum and rescaled accumulator (a row with
    no key yet keeps -inf and zeros)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    pr = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return pr, m_new, l_i * alpha + tl.sum(pr, axis=1), acc * alpha[:, None]


@triton.jit(do_not_specialize=["num_splits"])
def _mla_kernel(
    qlat_ptr,
    qpe_ptr,
    cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    req_ptr,
    qidx_ptr,
    topk_ptr,
    out_ptr,
    ws_o_ptr,
    ws_lse_ptr,
    qk_scale,
    num_splits,
    num_cand_k,
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_tk,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    LAT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_HH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    req = tl.load(req_ptr + t)
    seq_len = tl.load(seq_lens_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - tl.load(qsl_ptr + req)
    pos = seq_len - q_len + tl.load(qidx_ptr + t)
    if HAS_TOPK:
        use_idx = seq_len > num_cand_k
        n_cand = tl.where(use_idx, num_cand_k, pos + 1)
    else:
        use_idx = False
        n_cand = pos + 1
    n_cand = tl.maximum(n_cand, 0)

    heads = hb * BLOCK_HH + tl.arange(0, BLOCK_HH)
    h_ok = heads < NUM_HEADS
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    if EVEN:  # widths are their tiles: no feature masks, so gathers stay 16-byte wide
        l_ok = offs_l < BLOCK_L
        r_ok = offs_r < BLOCK_R
    else:
        l_ok = offs_l < LAT
        r_ok = offs_r < ROPE
    ql = tl.load(
        qlat_ptr + t * stride_qlt + heads[:, None] * stride_qlh + offs_l[None, :],
        mask=h_ok[:, None] & l_ok[None, :],
        other=0.0,
    )
    qr = tl.load(
        qpe_ptr + t * stride_qpt + heads[:, None] * stride_qph + offs_r[None, :],
        mask=h_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)

    chunk = tl.cdiv(tl.cdiv(n_cand, num_splits), BLOCK_N) * BLOCK_N
    start = sp * chunk
    end = tl.minimum(start + chunk, n_cand)
    m_i = tl.full([BLOCK_HH], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_HH], tl.float32)
    acc = tl.zeros([BLOCK_HH, BLOCK_L], tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_ok = j < end
        if HAS_TOPK:
            sel = tl.load(topk_ptr + t * stride_tk + j, mask=j_ok & use_idx, other=-1)
            p = tl.where(use_idx, sel.to(tl.int32), j)
        else:
            p = j
        ok = j_ok & (p >= 0) & (p <= pos)
        p = tl.where(ok, p, 0)
        blk = tl.load(bt_row + p // PAGE, mask=ok, other=0).to(tl.int64)
        row = blk * stride_cb + (p % PAGE).to(tl.int64) * stride_cs
        if EVEN:
            kl = tl.load(cache_ptr + row[:, None] + offs_l[None, :], mask=ok[:, None], other=0.0)
            kr = tl.load(
                cache_ptr + row[:, None] + LAT + offs_r[None, :], mask=ok[:, None], other=0.0
            )
        else:
            kl = tl.load(
                cache_ptr + row[:, None] + offs_l[None, :],
                mask=ok[:, None] & l_ok[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_L]
            kr = tl.load(
                cache_ptr + row[:, None] + LAT + offs_r[None, :],
                mask=ok[:, None] & r_ok[None, :],
                other=0.0,
            )
        kl = kl.to(ql.dtype)  # an fp8 cache is read in the query dtype (its scale: caller's)
        kr = kr.to(qr.dtype)
        s = tl.dot(ql, tl.trans(kl), input_precision=DOT_PREC)
        s = tl.dot(qr, tl.trans(kr), acc=s, input_precision=DOT_PREC)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        pr, m_i, l_i, acc = softmax_step(s, m_i, l_i, acc)
        acc = tl.dot(pr.to(kl.dtype), kl, acc=acc, input_precision=DOT_PREC)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        wrow = t * NUM_HEADS + heads
        tl.store(ws_lse_ptr + wrow * num_splits + sp, lse, mask=h_ok)
        ws = ws_o_ptr + (wrow[:, None] * num_splits + sp) * LAT + offs_l[None, :]
        tl.store(ws, o, mask=h_ok[:, None] & l_ok[None, :])
    else:
        dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_l[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & l_ok[None, :])


def choose_splits(
    num_tokens: int,
    num_heads: int,
    max_candidates: int,
    num_sms: int,
    lat: int = 512,
    config: MlaConfig | None = None,
) -> int:
    """Power-of-two split count from host facts (graph-safe): about ``CTAS_PER_SM``
    programs per multiprocessor (``WIDE_CTAS_PER_SM`` for 64-head programs), at least
    ``MIN_KEYS_PER_SPLIT`` candidates per split (``max_candidates``: ``K`` with top-k,
    else a static context bound). ``config``: the launch shape to split for (default:
    the one :func:`sparse_mla_attention` picks)."""
    cfg = config or _config(num_tokens, num_heads, max(16, next_pow2(lat)))
    programs = max(1, num_tokens * triton.cdiv(num_heads, cfg.block_h))
    per_sm = WIDE_CTAS_PER_SM if cfg.block_h >= CONFIG_WIDE.block_h else CTAS_PER_SM
    target = per_sm * num_sms
    s = 1
    while (
        s * 2 <= MAX_SPLITS
        and programs * s * 2 <= target
        and s * 2 * MIN_KEYS_PER_SPLIT <= max_candidates
    ):
        s *= 2
    return s


def check_widths(name: str, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the cache rows are the query's latent + rope widths and
    every operand has unit stride along its last dimension (the MLA kernels' contract)."""
    _, num_heads, lat = q_lat.shape
    rope = q_pe.shape[-1]
    width = cache.shape[2]
    if width != lat + rope or q_pe.shape[1] != num_heads:
        raise ValueError(f"cache width {width} != kv_lora_rank {lat} + rope {rope}")
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError(f"{name} needs unit stride along the last dimension")


def sparse_mla_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req_idx: torch.Tensor,
    token_q_idx: torch.Tensor,
    topk: torch.Tensor | None,
    scale: float,
    num_tokens: int,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    config: MlaConfig | None = None,
) -> torch.Tensor:
    """Attention of the first ``num_tokens`` rows of ``q_lat`` [T, H, L] / ``q_pe``
    [T, H, R] over ``cache`` [blocks, block_size, L + R]; returns ``out`` [T, H, L] (rows
    past ``num_tokens`` untouched). ``topk`` [T, K] (any int dtype) or None for dense.
    ``config``: the launch shape (default: by token count and heads, :func:`_config`)."""
    check_device(q_lat, "sparse_mla_attention")
    check_widths("sparse_mla_attention", q_lat, q_pe, cache)
    _, num_heads, lat = q_lat.shape
    rope = q_pe.shape[-1]
    page = cache.shape[1]
    if out is None:
        out = torch.empty_like(q_lat)
    if num_tokens == 0:
        return out
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    split = num_splits > 1
    ws_o = ws_lse = out
    if split:
        ws_o = torch.empty(num_tokens * num_heads * num_splits * lat, dtype=torch.float32,
                           device=q_lat.device)  # fmt: skip
        ws_lse = torch.empty(num_tokens * num_heads * num_splits, dtype=torch.float32,
                             device=q_lat.device)  # fmt: skip
    has_topk = topk is not None
    tk = topk if topk is not None else seq_lens
    block_l = max(16, next_pow2(lat))
    block_r = max(16, next_pow2(rope))
    block_h, block_n, warps, stages = config or _config(num_tokens, num_heads, block_l)
    _mla_kernel[(num_tokens, triton.cdiv(num_heads, block_h), num_splits)](
        q_lat,
        q_pe,
        cache,
        block_tables,
        seq_lens,
        query_start_loc,
        token_req_idx,
        token_q_idx,
        tk,
        out,
        ws_o,
        ws_lse,
        scale * LOG2E,
        num_splits,
        topk.shape[1] if topk is not None else 0,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        tk.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        LAT=lat,
        ROPE=rope,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        PAGE=page,
        BLOCK_HH=block_h,
        BLOCK_N=block_n if block_l <= 512 else 16,
        HAS_TOPK=has_topk,
        SPLIT=split,
        EVEN=block_l == lat and block_r == rope,
        DOT_PREC=dot_precision(q_lat.dtype),
        UPCAST=dot_upcast(q_lat.dtype),
        num_warps=warps,
        num_stages=stages,
        **pdl_args(q_lat.device),
    )
    if split:
        _reduce_kernel[(num_tokens, num_heads)](  # the split-K merge of decode attention
            ws_o,
            ws_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_D=lat,
            BLOCK_D=block_l,
            BLOCK_S=next_pow2(num_splits),
            num_warps=4,
            **pdl_args(out.device),
        )
    return out


def sparse_mla_reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    req: torch.Tensor,
    topk: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Plain torch, float32, one token at a time: ``positions`` [T] and ``req`` [T] give
    each token's place; keys are ``topk`` [T, K] (-1: none) or ``0..position``."""
    page, lat = cache.shape[1], q_lat.shape[-1]
    out = torch.zeros_like(q_lat)
    for t in range(q_lat.shape[0]):
        pos = int(positions[t])
        keys = torch.arange(pos + 1) if topk is None else topk[t][topk[t] >= 0].cpu()
        keys = keys[keys <= pos]
        if keys.numel() == 0:
            continue
        blk = block_tables[int(req[t])].cpu()[keys // page].long()
        rows = cache[blk, keys % page].float()  # [n, L + R]
        q = torch.cat([q_lat[t], q_pe[t]], dim=-1).float()  # [H, L + R]
        p = (q @ rows.T * scale).softmax(dim=-1)
        out[t] = (p @ rows[:, :lat]).to(out.dtype)
    return out
