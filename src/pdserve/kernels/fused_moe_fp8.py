"""Fused MoE experts with block-scaled FP8 weights (DeepSeek-V3 / GLM-5-FP8 experts).

The same pipeline as :mod:`pdserve.kernels.fused_moe` (tokens aligned by expert with
:func:`~pdserve.kernels.fused_moe.align_by_expert`, a grouped gate/up GEMM with
SiLU-and-mul fused, a grouped down GEMM scaled by the routing weights, a float32 sum of
each token's k rows, chunks of ``CHUNK_TOKENS`` tokens), with FP8 operands:

- **Weights** (the layout :class:`~pdserve.layers.moe.RoutedExperts` holds and
  :func:`~pdserve.kernels.reference.quantize_fp8_experts` builds): ``w13`` [E, 2I, H] and
  ``w2`` [E, H, I] in float8_e4m3fn; ``w13_scale_inv`` float32 [E, 2 * ceil(I/128),
  ceil(H/128)] holds each expert's gate scales (rows ``[0, ceil(I/128))``) then its up
  scales, each projection on its own 128x128 grid exactly as the checkpoint stores it
  (partial edge blocks included, so I and H need not be multiples of 128);
  ``w2_scale_inv`` float32 [E, ceil(H/128), ceil(I/128)].
- **Activations** are quantized inside the kernels, per token per 128-channel group
  (:func:`~pdserve.kernels._utils.quantize_rows_e4m3`, the values of
  :func:`~pdserve.kernels.reference.quantize_fp8_groups`): the gate/up kernel loads
  ``[BLOCK_M, 128]`` tiles of ``x``, takes each row's scale, casts to fp8 and feeds FP8
  MMAs. Its program covers one 128-column group of the intermediate dimension
  (``BLOCK_N`` = 128), so it quantizes its own float32 ``silu(gate) * up`` tile the same
  way and stores it as fp8 [T*k, I] plus float32 scales [T*k, ceil(I/128)]: the down
  kernel reads those directly (half the bytes of a bf16 intermediate, one rounding).
  Where ``x`` arrives as an :class:`~pdserve.kernels.reference.Fp8Activation` (the
  post-attention norm's fp8 output, quantized once per token in the norm's kernel;
  :func:`~pdserve.models.quantization.fuse_fp8_activations`), the gate/up kernel loads
  those fp8 rows and scales instead: no program quantizes ``x`` (each of the
  ``ceil(I/128)`` column programs of every expert block did, for each of a token's k
  pairs). A bf16 ``x`` at prefill sizes is quantized the same way by one
  :func:`~pdserve.kernels.activation.quantize_fp8` launch first; at decode sizes (one
  16-row block per expert) the kernel quantizes it in place.
- **Accumulation**: each 128-wide K step's partial product is multiplied by the
  activation scale of its row and the weight scale of its column's block and added to a
  float32 accumulator (``BLOCK_K`` is the 128-channel group, so a K step never straddles
  two scales).

Like the bf16 kernels, the launch depends on shapes only (no host sync), so a decode step
captures in a CUDA graph. Reference: :func:`~pdserve.kernels.reference.fused_experts_fp8_reference`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import (
    check_device,
    dot_fp8,
    fp8_mma,
    grouped_tile,
    interpret_mode,
    pdl_args,
    pdl_enter,
    quantize_rows_e4m3,
)
from pdserve.kernels.activation import quantize_fp8
from pdserve.kernels.fused_moe import align_pairs
from pdserve.kernels.moe_align import moe_combine
from pdserve.kernels.reference import FP8_DTYPE, FP8_GROUP, FP8_MAX, Fp8Activation

# tokens a launch pair takes: the bf16 kernel moved to 16K (run 51); this one keeps 4K until
# the FP8 MoE is swept there
CHUNK_TOKENS = 4096


@triton.jit
def _gate_up_fp8_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    out_scale_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    H,
    INTER,
    up_scale_row0,
    stride_xt,
    stride_xst,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    stride_os,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_DOT: tl.constexpr,
    QMAX: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    PRE_Q: tl.constexpr = False,
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
        cols = pid_n * GROUP + tl.arange(0, GROUP)  # one 128-column group
        n_ok = cols < INTER
        offs_k = tl.arange(0, GROUP)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = ws_ptr + e.to(tl.int64) * stride_se
        gate_scales = s_base + pid_n * stride_sn  # the gate's own block row, then the up's
        up_scales = s_base + (up_scale_row0 + pid_n) * stride_sn
        acc_g = tl.zeros([BLOCK_M, GROUP], tl.float32)
        acc_u = tl.zeros([BLOCK_M, GROUP], tl.float32)
        for kb in range(0, tl.cdiv(H, GROUP)):
            kk = kb * GROUP + offs_k
            k_ok = kk < H
            if PRE_Q:  # quantized once per token by the producer (the norm)
                a_q = tl.load(
                    x_ptr + tok[:, None] * stride_xt + kk[None, :],
                    mask=ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                a_scale = tl.load(xs_ptr + tok * stride_xst + kb, mask=ok, other=0.0)
            else:
                a = tl.load(
                    x_ptr + tok[:, None] * stride_xt + kk[None, :],
                    mask=ok[:, None] & k_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                a_q, a_scale = quantize_rows_e4m3(a, QMAX, ROUND_FIRST)
            wmask = k_ok[:, None] & n_ok[None, :]
            bg = tl.load(w_base + cols[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)
            bu = tl.load(
                w_base + (cols[None, :] + INTER) * stride_wn + kk[:, None], mask=wmask, other=0.0
            )
            sg = tl.load(gate_scales + kb)
            su = tl.load(up_scales + kb)
            acc_g += dot_fp8(a_q, bg, FP8_DOT) * (a_scale * sg)[:, None]
            acc_u += dot_fp8(a_q, bu, FP8_DOT) * (a_scale * su)[:, None]
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # columns past INTER are 0
        h_q, h_scale = quantize_rows_e4m3(h, QMAX, ROUND_FIRST)
        prow = pair.to(tl.int64)
        dst = out_ptr + prow[:, None] * stride_ot + cols[None, :]
        tl.store(dst, h_q, mask=ok[:, None] & n_ok[None, :])
        tl.store(out_scale_ptr + prow * stride_os + pid_n, h_scale, mask=ok)


@triton.jit
def _down_fp8_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    pairs_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    H,
    INTER,
    stride_at,
    stride_as,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_DOT: tl.constexpr,
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
        offs_k = tl.arange(0, GROUP)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        scales = ws_ptr + e.to(tl.int64) * stride_se + (cols // GROUP) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(0, tl.cdiv(INTER, GROUP)):
            kk = kb * GROUP + offs_k
            k_ok = kk < INTER
            a_q = tl.load(
                a_ptr + prow[:, None] * stride_at + kk[None, :],
                mask=ok[:, None] & k_ok[None, :],
                other=0.0,
            )  # fp8, quantized by the gate/up kernel
            a_scale = tl.load(a_scale_ptr + prow * stride_as + kb, mask=ok, other=0.0)
            b = tl.load(
                w_base + cols[None, :] * stride_wn + kk[:, None],
                mask=k_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            sb = tl.load(scales + kb, mask=n_ok, other=0.0)
            acc += dot_fp8(a_q, b, FP8_DOT) * a_scale[:, None] * sb[None, :]
        wt = tl.load(weights_ptr + prow, mask=ok, other=0.0).to(tl.float32)
        acc = acc * wt[:, None]
        dst = out_ptr + prow[:, None] * stride_ot + cols[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


class Fp8MoeTiles(NamedTuple):
    """Launch shape of both FP8 grouped GEMMs: rows a tile, the down kernel's column tile
    (the gate/up kernel's is the 128-column group), warps, and the program order (``group_m``
    > 1: that many row blocks sweep the column tiles together, as
    :class:`~pdserve.kernels.fused_moe.MoeConfig`'s)."""

    block_m: int
    down_n: int
    warps: int
    group_m: int = 1


def _fp8_config(num_pairs: int, num_experts: int) -> Fp8MoeTiles:
    """The tiles for ``num_pairs`` (token, expert) pairs. The gate/up kernel's N tile is the
    128-column group and BLOCK_K the 128-channel group in both; M tiles stop at 64 so
    the gate/up kernel's two [BLOCK_M, 128] float32 accumulators stay in registers.

    64-row tiles take 8 warps: with 4, the gate/up kernel compiled for sm_90a spills
    (tools/sm90_report.py's compile, 2026-12-05: 255 registers and 976 bytes of spill
    stores with a bf16 x, 192 with a pre-quantized x; 8 warps: 252 / 233 registers, no
    spills).
    128-row tiles compile with 16 warps at 128 registers and 8 bytes of spills (the same
    report, 2026-12-06; 8 warps: 255 and 24), the bf16 kernel's prefill tile, and are
    slower (``glm5_kernels_bench.py --sections moe_fp8``, RESULTS.md runs 94-95).

    From 17 pairs an expert, 8 row blocks sweep the column tiles together (H100, run 95,
    64 experts top-8, a pre-quantized x: 512 tokens 1.162 -> 1.134 ms, 4,096 tokens
    4.881 -> 4.568 ms)."""
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 16:  # decode: weight streaming, one 16-row block per expert
        return Fp8MoeTiles(16, 64, 4)
    return Fp8MoeTiles(64, 128, 8, group_m=8)


def fp8_expert_scale_shapes(
    num_experts: int, hidden: int, inter: int
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of ``w13_scale_inv`` and ``w2_scale_inv`` (see the module docstring)."""
    nbh, nbi = triton.cdiv(hidden, FP8_GROUP), triton.cdiv(inter, FP8_GROUP)
    return (num_experts, 2 * nbi, nbh), (num_experts, nbh, nbi)


def _check(
    x: torch.Tensor | Fp8Activation,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
) -> None:
    t, h = x.shape
    num_experts, two_i, hw = w13.shape
    inter = two_i // 2
    if hw != h or two_i % 2 or tuple(w2.shape) != (num_experts, h, inter):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit H={h}")
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(
            f"fused_experts_fp8 needs float8_e4m3fn weights, got {w13.dtype}/{w2.dtype}"
        )
    want13, want2 = fp8_expert_scale_shapes(num_experts, h, inter)
    for name, s, want in (("w13", w13_scale_inv, want13), ("w2", w2_scale_inv, want2)):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(
                f"{name}_scale_inv is {s.dtype} {tuple(s.shape)}, expected float32 {want} "
                f"(one scale per 128x128 block of every expert's projections)"
            )
        if s.stride(-1) != 1:
            raise ValueError(f"{name}_scale_inv needs unit stride along its last dimension")
    xs = (x.q, x.scale) if isinstance(x, Fp8Activation) else (x,)
    if any(t.stride(-1) != 1 for t in (*xs, w13, w2)):
        raise ValueError("fused_experts_fp8 needs unit stride along the last dimension")


def fused_experts_fp8(
    x: torch.Tensor | Fp8Activation,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    tiles: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Routed experts' output [T, H] in ``x``'s dtype (bf16/fp16/fp32) with block-FP8
    expert weights: ``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``,
    ``e = ids[t, j]``, activations quantized per token per 128 channels (module doc),
    plus ``add`` [T, H] where given. An :class:`Fp8Activation` ``x`` (quantized once per
    token by its producer) is read as it is; the output then has its ``dtype``.
    ``tiles``: the fields of an :class:`Fp8MoeTiles` (``group_m`` may be left out) instead
    of :func:`_fp8_config`'s (for sweeps)."""
    check_device(x.q if isinstance(x, Fp8Activation) else x, "fused_experts_fp8")
    _check(x, w13, w13_scale_inv, w2, w2_scale_inv)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    step = CHUNK_TOKENS
    for a in range(0, x.shape[0], step):
        b = min(x.shape[0], a + step)
        extra = add[a:b] if add is not None else None
        xc = x.rows(a, b) if isinstance(x, Fp8Activation) else x[a:b]
        _fp8_chunk(
            xc, w13, w13_scale_inv, w2, w2_scale_inv, weights[a:b], ids[a:b], out[a:b], extra,
            tiles,
        )  # fmt: skip
    return out


def _fp8_chunk(
    x: torch.Tensor | Fp8Activation,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    add: torch.Tensor | None,
    tiles: tuple[int, ...] | None = None,
) -> None:
    t, h = x.shape
    k = ids.shape[1]
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    n = t * k
    if n == 0:
        return
    bm, bn, warps, group_m = Fp8MoeTiles(*tiles) if tiles else _fp8_config(n, num_experts)
    if bm > 16 and not isinstance(x, Fp8Activation):
        # prefill sizes: quantize each token once here rather than in every one of the
        # ceil(I/128) column programs of each of its k pairs' blocks (the same values)
        x = quantize_fp8(x)
    pairs, block_expert = align_pairs(ids, num_experts, bm)
    nb = block_expert.shape[0]
    interp = interpret_mode()
    stages = 1 if interp else 3
    fp8_dot = fp8_mma(x.device)
    mid = Fp8Activation.empty((n, inter), x.dtype, x.device)  # the quantized SiLU-and-mul
    act, act_scale = mid.q, mid.scale
    pre_q = isinstance(x, Fp8Activation)
    xv, xs = (x.q, x.scale) if isinstance(x, Fp8Activation) else (x, x)
    _gate_up_fp8_kernel[(nb, act_scale.shape[1])](
        xv,
        xs,
        w13,
        w13_scale_inv,
        act,
        act_scale,
        pairs,
        block_expert,
        n,
        h,
        inter,
        w13_scale_inv.shape[1] // 2,
        xv.stride(0),
        xs.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale_inv.stride(0),
        w13_scale_inv.stride(1),
        act.stride(0),
        act_scale.stride(0),
        TOPK=k,
        BLOCK_M=bm,
        GROUP=FP8_GROUP,
        FP8_DOT=fp8_dot,
        QMAX=FP8_MAX,
        ROUND_FIRST=interp,
        PRE_Q=pre_q,
        GROUP_M=group_m,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(xv.device),
    )
    per_pair = torch.empty(n, h, dtype=x.dtype, device=x.device)
    _down_fp8_kernel[(nb, triton.cdiv(h, bn))](
        act,
        act_scale,
        w2,
        w2_scale_inv,
        per_pair,
        pairs,
        block_expert,
        weights.reshape(-1).to(torch.float32),
        n,
        h,
        inter,
        act.stride(0),
        act_scale.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale_inv.stride(0),
        w2_scale_inv.stride(1),
        per_pair.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        GROUP=FP8_GROUP,
        FP8_DOT=fp8_dot,
        GROUP_M=group_m,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(act.device),
    )
    moe_combine(per_pair, k, out, add)
