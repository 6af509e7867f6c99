"""Sparse MLA for prefill-sized launches (issue 26): candidate cache rows resolved once.

:func:`pdserve.kernels.sparse_mla.sparse_mla_attention` (the decode / verify / prefill
kernel) maps each tile of candidates through two dependent loads inside its loop: the
token's top-k position, then the request's block table, then the cache rows. With one
144 KB program per multiprocessor that chain is exposed latency. Here a small kernel
(:func:`candidate_rows`) translates each token's candidates once per layer into physical
cache rows (``block * page + offset``, int32, -1 for none) and their count, and the
attention kernel (:func:`sparse_mla_prefill`) streams ``rows[t]``: one level of
indirection, so the software pipeliner prefetches the index tile and the row gathers
stages ahead. The candidates are the same as the general kernel's, chosen per token:
``topk[t]`` when the request's context exceeds ``K``, else every causal key
``0 .. pos`` (then ``pos < K``, so both fit a row of ``K``).

Variants (:data:`VARIANTS`, measured by ``benchmarks/prefill_sweep.py --sections
mla_variants``; :data:`DEFAULT_VARIANT` is the engine's prefill default,
``layers/attention/mla_triton.py``); dropped after run 45: 16-key tiles on 9 stages
(41.2 ms at 16K) and the latent split with 32-key tiles on 7 stages (32.9 ms):

- ``lat_split`` 1: a program holds every latent dim of its head block (a [64, 512]
  float32 accumulator over two warpgroups, like the general kernel's WIDE config);
  2: two programs per (token, head block), each accumulating half of the latent dims
  (one warpgroup, no cross-warpgroup exchange of the probabilities) and each computing
  the full 576-dim scores (the general kernel's two warpgroups compute them twice
  already, so the tensor work is the same).
- ``lazy``: rescale the accumulator only when some row's running maximum grows by more
  than ``LAZY_TAU`` (log2 units, so probabilities stay below 2^8 before the bf16 cast);
  exact, since the sum and the accumulator always share the maximum actually used.

Cache rows are addressed as ``row * stride(1)``, so the cache's pages must be contiguous
(``stride(0) == block_size * stride(1)``, as the engine allocates them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import LOG2E, check_device, dot_precision, dot_upcast, next_pow2
from pdserve.kernels.sparse_mla import check_widths, softmax_step

LAZY_TAU = 8.0
ROWS_BLOCK = 256


class PrefillVariant(NamedTuple):
    """Launch shape of :func:`sparse_mla_prefill`: heads per program, candidates per tile,
    warps, pipeline stages, programs sharing a token's latent dims, lazy rescale."""

    block_h: int
    block_n: int
    warps: int
    stages: int
    lat_split: int = 1
    lazy: bool = False


# Triton 3.6 sizes the ring of gathered tiles from num_stages: the index tile takes a
# stage of its own, so stages 3-4 give two buffers waited at once (no lookahead), 5-6
# three, 7-8 four, 9 five (sm_90a compiles, tools/sm90_report.py --only mla_pf_...).
VARIANTS: dict[str, PrefillVariant] = {
    # H200, RESULTS.md run 45 (16K prefill, ms a layer with candidate rows; the general
    # kernel: 33.4 at its old default, 31.5 at its prefill shape)
    "rows_n32_s5": PrefillVariant(64, 32, 8, 5),  # 26.4; 3 x 36 KB of rows in flight
    "rows_n32_s7": PrefillVariant(64, 32, 8, 7),  # 27.4; 4 x 36 KB, 217 KB
    "lazy_n16_s7": PrefillVariant(64, 16, 8, 7, lazy=True),  # 42.5; 4 x 18 KB, 145 KB
    "half_n16_s3": PrefillVariant(64, 16, 4, 3, lat_split=2),  # 26.6; 108 KB: 2 an SM
    # not measured yet: 64-key tiles (a wider score MMA a warpgroup; 217 KB, no spills),
    # the latent split with 32-key tiles or deeper 16-key rings
    "rows_n64_s3": PrefillVariant(64, 64, 8, 3),
    "half_n32_s3": PrefillVariant(64, 32, 4, 3, lat_split=2),
    "half_n16_s5": PrefillVariant(64, 16, 4, 5, lat_split=2),
}
DEFAULT_VARIANT = "rows_n32_s5"


@triton.jit
def _rows_kernel(
    topk_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    req_ptr,
    qidx_ptr,
    rows_ptr,
    ncand_ptr,
    num_cand_k,
    stride_tk,
    stride_bt,
    stride_rt,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    jb = tl.program_id(1)
    req = tl.load(req_ptr + t)
    seq_len = tl.load(seq_lens_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - tl.load(qsl_ptr + req)
    pos = seq_len - q_len + tl.load(qidx_ptr + t)
    # a row with at most K causal keys attends to all of them (its top-K is every key):
    # positions 0 .. pos, pos + 1 candidates, not K entries with the causal mask's holes
    use_idx = (seq_len > num_cand_k) & (pos >= num_cand_k)
    n_cand = tl.maximum(tl.where(use_idx, num_cand_k, pos + 1), 0)
    if jb == 0:
        tl.store(ncand_ptr + t, n_cand.to(tl.int32))
    j = jb * BLOCK + tl.arange(0, BLOCK)
    j_in = j < num_cand_k
    j_ok = j < n_cand
    sel = tl.load(topk_ptr + t * stride_tk + j, mask=j_ok & use_idx, other=-1)
    p = tl.where(use_idx, sel.to(tl.int64), j.to(tl.int64))
    ok = j_ok & (p >= 0) & (p <= pos)
    p = tl.where(ok, p, 0)
    blk = tl.load(bt_ptr + req.to(tl.int64) * stride_bt + p // PAGE, mask=ok, other=0)
    row = tl.where(ok, blk.to(tl.int64) * PAGE + p % PAGE, -1)
    tl.store(rows_ptr + t * stride_rt + j, row.to(tl.int32), mask=j_in)


def candidate_rows(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req_idx: torch.Tensor,
    token_q_idx: torch.Tensor,
    topk: torch.Tensor,
    page: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's candidate cache rows ``[num_tokens, K]`` int32 (-1: none) and their
    count ``[num_tokens]`` int32 (entries past it are -1): ``topk[t]`` mapped through the
    block table when the row has more than ``K`` causal keys, else positions ``0 .. pos``
    (the top-K of at most K keys is all of them: the indexer's selection adds only masked
    positions, so the first ``K`` rows of a long prompt do causal work, not ``K`` pairs
    each)."""
    check_device(topk, "candidate_rows")
    k = topk.shape[1]
    rows = torch.empty(num_tokens, k, dtype=torch.int32, device=topk.device)
    ncand = torch.empty(num_tokens, dtype=torch.int32, device=topk.device)
    if num_tokens == 0 or k == 0:
        return rows, ncand.zero_()
    block = min(ROWS_BLOCK, next_pow2(k))
    _rows_kernel[(num_tokens, triton.cdiv(k, block))](
        topk, block_tables, seq_lens, query_start_loc, token_req_idx, token_q_idx, rows, ncand,
        k, topk.stride(0), block_tables.stride(0), rows.stride(0), PAGE=page, BLOCK=block,
    )  # fmt: skip
    return rows, ncand


@triton.jit
def _prefill_kernel(
    qlat_ptr,
    qpe_ptr,
    cache_ptr,
    rows_ptr,
    ncand_ptr,
    out_ptr,
    qk_scale,
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_cs,
    stride_rt,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    LAT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LAT_SPLIT: tl.constexpr,
    LAZY: tl.constexpr,
    TAU: tl.constexpr,
    EVEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1) // LAT_SPLIT
    part = tl.program_id(1) % LAT_SPLIT
    n_cand = tl.load(ncand_ptr + t)
    HALF: tl.constexpr = BLOCK_L // LAT_SPLIT  # latent dims this program accumulates
    heads = hb * BLOCK_HH + tl.arange(0, BLOCK_HH)
    h_ok = heads < NUM_HEADS
    offs_a = part * HALF + tl.arange(0, HALF)  # this program's latent dims
    offs_b = (1 - part) * HALF + tl.arange(0, HALF)  # the others' (scores only)
    offs_r = tl.arange(0, BLOCK_R)
    if EVEN:  # widths are their tiles: no feature masks, so gathers stay 16-byte wide
        a_ok = offs_a < BLOCK_L
        b_ok = offs_b < BLOCK_L
        r_ok = offs_r < BLOCK_R
    else:
        a_ok = offs_a < LAT
        b_ok = offs_b < LAT
        r_ok = offs_r < ROPE
    q_base = qlat_ptr + t * stride_qlt + heads[:, None] * stride_qlh
    qa = tl.load(q_base + offs_a[None, :], mask=h_ok[:, None] & a_ok[None, :], other=0.0)
    if LAT_SPLIT == 2:
        qb = tl.load(q_base + offs_b[None, :], mask=h_ok[:, None] & b_ok[None, :], other=0.0)
    else:
        qb = qa  # unused
    qr = tl.load(
        qpe_ptr + t * stride_qpt + heads[:, None] * stride_qph + offs_r[None, :],
        mask=h_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        qa = qa.to(tl.float32)
        qb = qb.to(tl.float32)
        qr = qr.to(tl.float32)

    m_i = tl.full([BLOCK_HH], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_HH], tl.float32)
    acc = tl.zeros([BLOCK_HH, HALF], tl.float32)
    row_base = rows_ptr + t * stride_rt
    for n0 in range(0, n_cand, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        r = tl.load(row_base + j, mask=j < n_cand, other=-1)
        ok = r >= 0
        row = tl.where(ok, r, 0).to(tl.int64) * stride_cs
        ka = tl.load(
            cache_ptr + row[:, None] + offs_a[None, :], mask=ok[:, None] & a_ok[None, :], other=0.0
        ).to(qa.dtype)  # [BLOCK_N, HALF]; an fp8 cache is read in the query dtype
        kr = tl.load(
            cache_ptr + row[:, None] + LAT + offs_r[None, :],
            mask=ok[:, None] & r_ok[None, :],
            other=0.0,
        ).to(qr.dtype)
        s = tl.dot(qa, tl.trans(ka), input_precision=DOT_PREC)
        if LAT_SPLIT == 2:
            kb = tl.load(
                cache_ptr + row[:, None] + offs_b[None, :],
                mask=ok[:, None] & b_ok[None, :],
                other=0.0,
            ).to(qb.dtype)
            s = tl.dot(qb, tl.trans(kb), acc=s, input_precision=DOT_PREC)
        s = tl.dot(qr, tl.trans(kr), acc=s, input_precision=DOT_PREC)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        if LAZY:
            m_tile = tl.maximum(m_i, tl.max(s, axis=1))
            # rescale (every row: one decision for the block) only when a row's maximum
            # outgrows the one in use by more than TAU; -inf rows stay -inf
            grow = tl.max(tl.where(m_tile > m_i + TAU, 1, 0), axis=0)
            if grow > 0:
                m_safe = tl.where(m_tile == float("-inf"), 0.0, m_tile)
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_tile
            m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
            pr = tl.exp2(s - m_use[:, None])
            l_i = l_i + tl.sum(pr, axis=1)
        else:
            pr, m_i, l_i, acc = softmax_step(s, m_i, l_i, acc)
        acc = tl.dot(pr.to(ka.dtype), ka, acc=acc, input_precision=DOT_PREC)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_a[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & a_ok[None, :])


def launch_constexprs(
    num_heads: int, lat: int, rope: int, v: PrefillVariant, dtype: torch.dtype
) -> dict[str, object]:
    """The kernel's compile-time arguments for a launch (shared with tools/sm90_report)."""
    block_l = max(16 * v.lat_split, next_pow2(lat))
    block_r = max(16, next_pow2(rope))
    return dict(
        NUM_HEADS=num_heads, LAT=lat, ROPE=rope, BLOCK_L=block_l, BLOCK_R=block_r,
        BLOCK_HH=min(v.block_h, max(16, next_pow2(num_heads))), BLOCK_N=v.block_n,
        LAT_SPLIT=v.lat_split, LAZY=v.lazy, TAU=LAZY_TAU,
        EVEN=block_l == lat and block_r == rope, DOT_PREC=dot_precision(dtype),
        UPCAST=dot_upcast(dtype),
    )  # fmt: skip


def check_operands(name: str, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                   rows: torch.Tensor, num_tokens: int) -> None:  # fmt: skip
    """Raise ``ValueError`` unless the prefill kernels (this one, the Gluon one) can
    address these operands: matching widths, unit last strides, contiguous cache pages,
    int32 candidate rows covering ``num_tokens``."""
    check_widths(name, q_lat, q_pe, cache)
    page = cache.shape[1]
    if cache.stride(0) != page * cache.stride(1):
        raise ValueError(f"{name} addresses rows as block * page + offset: the cache's "
                         "pages must be contiguous")  # fmt: skip
    if rows.dtype != torch.int32 or rows.shape[0] < num_tokens or rows.stride(-1) != 1:
        raise ValueError("rows: int32 [T, K] from candidate_rows")


def sparse_mla_prefill(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    rows: torch.Tensor,
    ncand: torch.Tensor,
    scale: float,
    num_tokens: int,
    out: torch.Tensor | None = None,
    variant: PrefillVariant | str = DEFAULT_VARIANT,
) -> torch.Tensor:
    """Attention of the first ``num_tokens`` rows of ``q_lat`` [T, H, L] / ``q_pe`` [T, H, R]
    over the cache rows :func:`candidate_rows` resolved (``rows`` [T, K], ``ncand`` [T]);
    returns ``out`` [T, H, L], the same as :func:`~pdserve.kernels.sparse_mla.
    sparse_mla_attention` on the same top-k (rows past ``num_tokens`` untouched)."""
    check_device(q_lat, "sparse_mla_prefill")
    v = VARIANTS[variant] if isinstance(variant, str) else variant
    if v.lat_split not in (1, 2):
        raise ValueError(f"lat_split {v.lat_split}: 1 or 2")
    check_operands("sparse_mla_prefill", q_lat, q_pe, cache, rows, num_tokens)
    _, num_heads, lat = q_lat.shape
    rope = q_pe.shape[-1]
    if out is None:
        out = torch.empty_like(q_lat)
    if num_tokens == 0:
        return out
    c = launch_constexprs(num_heads, lat, rope, v, q_lat.dtype)
    grid = (num_tokens, triton.cdiv(num_heads, int(c["BLOCK_HH"])) * v.lat_split)  # type: ignore[call-overload]
    _prefill_kernel[grid](
        q_lat, q_pe, cache, rows, ncand, out, scale * LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(1),
        rows.stride(0), out.stride(0), out.stride(1),
        **c, num_warps=v.warps, num_stages=v.stages,
    )  # fmt: skip
    return out
