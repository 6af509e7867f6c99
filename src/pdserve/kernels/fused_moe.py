"""Fused MoE experts: tokens aligned by expert, then two grouped GEMMs.

Input: tokens ``x`` [T, H], their routing ``ids`` / ``weights`` [T, k] (from the router),
stacked expert weights ``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2`` [E, H, I].

1. **Align** (:func:`align_by_expert`, torch ops on the device, no host sync): the ``T*k``
   (token, slot) pairs are ordered by expert and each expert's run is padded to a
   multiple of ``BLOCK_M``; ``sorted_pairs`` lists pair ids (``T*k`` marks padding) and
   ``block_expert`` names each block's expert (-1: a block past the last one). The
   buffers are sized from host ints only (``T``, ``k``, ``E``, ``BLOCK_M``): at most
   ``cdiv(T*k, BLOCK_M) + min(E, T*k)`` blocks can be non-empty, so a decode batch has
   static shapes and captures in a CUDA graph.
2. **Gate/up GEMM** (``_gate_up_kernel``): program (block, column tile) multiplies the
   block's token rows by its expert's gate and up rows at once and stores
   ``silu(gate) * up`` per pair ([T*k, I]); the [T*k, 2I] product never exists.
3. **Down GEMM** (``_down_kernel``): program (block, column tile) multiplies the block's
   pair rows by its expert's ``w2`` and scales each row by its routing weight ([T*k, H]).
4. The k rows of each token are summed in float32 (a deterministic reduction, no atomics),
   plus ``add`` (the shared experts' output) where given.

Decode-sized batches align in one launch and sum in one (:mod:`pdserve.kernels.moe_align`):
four launches for the routed experts.

Each block reads its expert's weight tile once for up to ``BLOCK_M`` pairs, so a decode
step reads every chosen expert's weights once. Prefill batches are processed in chunks
of ``CHUNK_TOKENS`` tokens (``MoeConfig.chunk_tokens``) to bound the [T*k, H] buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import (
    check_device,
    dot_precision,
    dot_upcast,
    grouped_tile,
    pdl_args,
    pdl_enter,
)
from pdserve.kernels.moe_align import align_fits, moe_align, moe_combine

# one launch pair takes up to 16K tokens: H200 sweep of 2026-12-05 (RESULTS.md run 51), 8K
# tokens as one chunk with grouped program order 11.67 -> 9.86 ms a layer
CHUNK_TOKENS = 16384


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [NB * block_m] int32, block_expert [NB] int32) for ``ids`` [T, k].

    Pair ``p = t * k + j`` is token ``t``'s ``j``-th expert. Within an expert, pairs keep
    their order. Padding entries hold ``T * k``. Graph-safe: no host reads.
    """
    t, k = ids.shape
    n = t * k
    dev = ids.device
    nb = triton.cdiv(n, block_m) + min(num_experts, n)
    flat = ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    start = counts.cumsum(0) - counts
    order = flat.argsort(stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - start[sorted_e]
    dest = pad_start[sorted_e] + rank
    sorted_pairs = torch.full((nb * block_m,), n, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    first_row = torch.arange(nb, device=dev, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(pad_end, first_row, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    H,
    INTER,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ot,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    GROUP_M: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_m, pid_n = grouped_tile(GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + rows)
        ok = pair < num_pairs
        tok = tl.where(ok, pair // TOPK, 0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < INTER
        offs_k = tl.arange(0, BLOCK_K)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < H
            a = tl.load(
                x_ptr + tok[:, None] * stride_xt + kk[None, :],
                mask=ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            wmask = k_ok[:, None] & n_ok[None, :]
            bg = tl.load(w_base + cols[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)
            bu = tl.load(
                w_base + (cols[None, :] + INTER) * stride_wn + kk[:, None], mask=wmask, other=0.0
            )
            if UPCAST:
                a = a.to(tl.float32)
                bg = bg.to(tl.float32)
                bu = bu.to(tl.float32)
            acc_g = tl.dot(a, bg, acc=acc_g, input_precision=DOT_PREC)
            acc_u = tl.dot(a, bu, acc=acc_u, input_precision=DOT_PREC)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        dst = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + cols[None, :]
        tl.store(dst, h.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    pairs_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    H,
    INTER,
    stride_at,
    stride_we,
    stride_wn,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    GROUP_M: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_m, pid_n = grouped_tile(GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + rows)
        ok = pair < num_pairs
        prow = tl.where(ok, pair, 0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < H
        offs_k = tl.arange(0, BLOCK_K)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < INTER
            a = tl.load(
                a_ptr + prow[:, None] * stride_at + kk[None, :],
                mask=ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_base + cols[None, :] * stride_wn + kk[:, None],
                mask=k_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc=acc, input_precision=DOT_PREC)
        wt = tl.load(weights_ptr + prow, mask=ok, other=0.0).to(tl.float32)
        acc = acc * wt[:, None]
        dst = out_ptr + prow[:, None] * stride_ot + cols[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


class MoeConfig(NamedTuple):
    """Tile shape of both grouped GEMMs, warps, software-pipelining stages and the
    program order (``group_m`` > 1: that many row blocks sweep the column tiles together,
    so the programs running at once share their rows' tokens and each weight tile; 1:
    row blocks fastest, every column tile of a block far apart in time), the tokens a
    launch pair takes (``chunk_tokens``; 0: ``CHUNK_TOKENS``; every chunk reads the
    experts' weights again) and the down GEMM's column tile (``down_n``; 0: ``block_n``:
    its K is the intermediate width, a third of the gate/up GEMM's work a tile at equal
    tiles, so wider tiles amortize each tile's start and its scattered store)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int = 3
    group_m: int = 1
    chunk_tokens: int = 0
    down_n: int = 0


def _config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Small M tiles when few pairs share an expert."""
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 16:  # decode: weight streaming, one 16-row block per expert
        return MoeConfig(16, 64, 128, 4)
    # 128-row tiles from 64 pairs an expert on: H200 sweep of 2026-12-05 (RESULTS.md run
    # 41, 64 experts top-8): 512 tokens 1.58 -> 1.46 ms, 1024 tokens 2.34 -> 2.01 ms
    if per_expert <= 32:
        return MoeConfig(64, 128, 64, 4)
    # grouped program order, and 256-column down tiles: run 51, 64 experts top-8: 2K
    # tokens 3.33 -> 2.95 ms, 4K 5.96 -> 5.21, 8K (one chunk) 9.86
    if per_expert <= 64:
        return MoeConfig(128, 128, 64, 8, group_m=8, down_n=256)
    # and beyond, with 4 stages: H100 sweeps (RESULTS.md run 60, 16K chunks: 8K tokens
    # 10.37 -> 9.33 ms, 16K 19.59 -> 18.29; run 71, verify sizes: 1K tokens 2.35 -> 2.28,
    # 2K 3.37 -> 3.14; 512 tokens, 64 pairs an expert, 1.90 with 3 stages, 1.91 with 4)
    return MoeConfig(128, 128, 64, 8, stages=4, group_m=8, down_n=256)


SHARED_BUDGET = 200 * 1024  # bytes of operand ring a program may take (Hopper has 227 KiB)


def ring_bytes(cfg: MoeConfig, elt_size: int) -> int:
    """Shared memory the larger of the two GEMMs' operand rings takes: ``stages - 1``
    steps of its A and B tiles (gate and up, or down), as Triton allocates them."""
    b = cfg.block_k * max(2 * cfg.block_n, cfg.down_n or cfg.block_n)
    return max(cfg.stages - 1, 1) * (cfg.block_m * cfg.block_k + b) * elt_size


def fit_shared(cfg: MoeConfig, elt_size: int) -> MoeConfig:
    """``cfg`` with fewer pipeline stages (down to 2), then a narrower K step, until
    :func:`ring_bytes` fits ``SHARED_BUDGET`` for ``elt_size``-byte operands: the 16-bit
    defaults fit as they are, float32 models (the GPU tests) need a shorter ring."""
    while ring_bytes(cfg, elt_size) > SHARED_BUDGET and cfg.stages > 2:
        cfg = cfg._replace(stages=cfg.stages - 1)
    while ring_bytes(cfg, elt_size) > SHARED_BUDGET and cfg.block_k > 16:
        cfg = cfg._replace(block_k=cfg.block_k // 2)
    return cfg


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor | None = None,
    config: MoeConfig | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts' output [T, H] in ``x``'s dtype: ``sum_j weights[t, j] *
    down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = ids[t, j]``, plus ``add`` [T, H]
    (rounded as ``routed + add`` rounds). ``config``: the launch shape (default: by
    pairs per expert, :func:`_config`)."""
    check_device(x, "fused_experts")
    t, h = x.shape
    num_experts, two_i, hw = w13.shape
    if hw != h or w2.shape != (num_experts, h, two_i // 2):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit H={h}")
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_experts needs unit stride along the last dimension")
    if out is None:
        out = torch.empty_like(x)
    chunk = (config.chunk_tokens if config is not None else 0) or CHUNK_TOKENS
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        extra = add[a:b] if add is not None else None
        _fused_chunk(x[a:b], w13, w2, weights[a:b], ids[a:b], out[a:b], config, extra)
    return out


def align_pairs(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`align_by_expert`'s result: one launch where the batch fits
    (:func:`~pdserve.kernels.moe_align.moe_align`), else the torch ops."""
    if align_fits(ids.numel(), num_experts):
        return moe_align(ids, num_experts, block_m)
    return align_by_expert(ids, num_experts, block_m)


def _fused_chunk(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    config: MoeConfig | None,
    add: torch.Tensor | None,
) -> None:
    t, h = x.shape
    k = ids.shape[1]
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    n = t * k
    if n == 0:
        return
    cfg = config or fit_shared(_config(n, num_experts), x.element_size())
    bm, bn, bk, warps, stages, group_m, _, down_n = cfg
    down_n = down_n or bn
    pairs, block_expert = align_pairs(ids, num_experts, bm)
    nb = block_expert.shape[0]
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    prec, up = dot_precision(x.dtype), dot_upcast(x.dtype)
    _gate_up_kernel[(nb, triton.cdiv(inter, bn))](
        x,
        w13,
        act,
        pairs,
        block_expert,
        n,
        h,
        inter,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        TOPK=k,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_PREC=prec,
        UPCAST=up,
        GROUP_M=group_m,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(x.device),
    )
    per_pair = torch.empty(n, h, dtype=x.dtype, device=x.device)
    wflat = weights.reshape(-1).to(torch.float32)
    _down_kernel[(nb, triton.cdiv(h, down_n))](
        act,
        w2,
        per_pair,
        pairs,
        block_expert,
        wflat,
        n,
        h,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        per_pair.stride(0),
        BLOCK_M=bm,
        BLOCK_N=down_n,
        BLOCK_K=bk,
        DOT_PREC=prec,
        UPCAST=up,
        GROUP_M=group_m,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(act.device),
    )
    moe_combine(per_pair, k, out, add)


def fused_experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Plain torch, float32 math: each (token, slot) pair through its expert (host loop)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].float() @ x[t].float()
            hdn = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += float(weights[t, j]) * (w2[e].float() @ hdn)
    return out.to(x.dtype)
