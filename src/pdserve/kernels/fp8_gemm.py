"""Block-scaled FP8 GEMM: ``y = x W^T`` with ``W`` in float8_e4m3fn, one scale per block.

Weights: ``w`` [N, K] fp8 and ``w_scale_inv`` float32 [ceil(N / SCALE_N), ceil(K / 128)]
(DeepSeek-V3's layout with ``SCALE_N`` 128; 1 when a merged projection's parts do not
start on 128-row boundaries, see :mod:`pdserve.layers.fp8`). Activations arrive in
bf16/fp16/fp32 and are quantized on the fly, inside the kernel: each program loads a
``[BLOCK_M, 128]`` tile of ``x``, takes each row's absolute maximum over those 128
channels (one scale per token per 128-channel group, as the reference
:func:`~pdserve.kernels.reference.quantize_fp8_groups` does), scales and casts it to fp8
and feeds FP8 tensor-core MMAs; the partial product of each 128-wide K step is
multiplied by the activation and weight scales and accumulated in float32.

Decode batches have few rows, so the N tiles alone cannot occupy the GPU; the K range is
then split over several programs (split-K) whose float32 partials one ``sum`` adds up.
The grid depends only on shapes (no host sync), so the launch can be captured in a CUDA
graph.

``torch._scaled_mm`` with 1x128 / 128x128 block scales (PyTorch's blockwise FP8 recipe,
Hopper only) is an alternative for large M; :func:`scaled_mm_block_fp8` wraps it and
:mod:`pdserve.layers.fp8` checks it once against the reference before using it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import (
    check_device,
    dot_fp8,
    fp8_mma,
    interpret_mode,
    num_sms,
    quantize_rows_e4m3,
)
from pdserve.kernels.reference import FP8_GROUP, FP8_MAX

GROUP_K = FP8_GROUP


@triton.jit(do_not_specialize=["M", "k_blocks_per_split"])  # one compile per tile config
def _block_fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_os,
    stride_om,
    k_blocks_per_split,
    SCALE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP8_DOT: tl.constexpr,
    QMAX: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_scale_rows = (offs_n // SCALE_N).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb0 = split * k_blocks_per_split
    num_kb = tl.cdiv(K, BLOCK_K)
    for kb in range(kb0, tl.minimum(kb0 + k_blocks_per_split, num_kb)):
        ks = kb * BLOCK_K + offs_k
        k_ok = ks < K
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        a_q, a_scale = quantize_rows_e4m3(a, QMAX, ROUND_FIRST)  # a_scale: [BLOCK_M]
        b = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + ks[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N] fp8
        part = dot_fp8(a_q, b, FP8_DOT)
        b_scale = tl.load(ws_ptr + w_scale_rows + kb, mask=n_ok, other=0.0)  # [BLOCK_N]
        acc += part * a_scale[:, None] * b_scale[None, :]
    out = out_ptr + split * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def choose_splits(m_tiles: int, n_tiles: int, k_blocks: int, sms: int) -> int:
    """K splits so that about two programs run per multiprocessor (1 for large batches)."""
    tiles = m_tiles * n_tiles
    if tiles >= sms:
        return 1
    return max(1, min(k_blocks, -(-2 * sms // tiles), 16))


def block_fp8_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale_inv: torch.Tensor,
    scale_n: int = GROUP_K,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``x`` [..., K] (bf16/fp16/fp32) times ``w`` [N, K] fp8 transposed, with
    ``w_scale_inv`` [ceil(N/scale_n), ceil(K/128)]; returns [..., N] in ``out_dtype``
    (default ``x``'s dtype). ``num_splits`` overrides the split-K heuristic (tests)."""
    check_device(x, "block_fp8_gemm")
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    if w.shape[1] != k or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn [N, {k}], got {w.dtype} {tuple(w.shape)}")
    k_blocks = triton.cdiv(k, GROUP_K)
    if tuple(w_scale_inv.shape) != (triton.cdiv(n, scale_n), k_blocks):
        raise ValueError(
            f"weight_scale_inv has shape {tuple(w_scale_inv.shape)}, expected "
            f"{(triton.cdiv(n, scale_n), k_blocks)} for {n}x{k} weights in {scale_n}x128 blocks"
        )
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    dtype = out_dtype or x.dtype
    if m == 0:
        return x.new_empty(*lead, n, dtype=dtype)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    m_tiles, n_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    splits = num_splits or choose_splits(m_tiles, n_tiles, k_blocks, num_sms(x.device))
    per_split = triton.cdiv(k_blocks, splits)
    splits = triton.cdiv(k_blocks, per_split)
    if splits == 1:
        out = torch.empty(1, m, n, dtype=dtype, device=x.device)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    ws = w_scale_inv.float().contiguous()
    _block_fp8_gemm_kernel[(m_tiles, n_tiles, splits)](
        x2,
        w,
        ws,
        out,
        m,
        n,
        k,
        x2.stride(0),
        w.stride(0),
        ws.stride(0),
        out.stride(0),
        out.stride(1),
        per_split,
        SCALE_N=scale_n,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=GROUP_K,
        FP8_DOT=fp8_mma(x.device),
        QMAX=FP8_MAX,
        ROUND_FIRST=interpret_mode(),
        num_warps=4,
        num_stages=1 if interpret_mode() else 3,
    )
    y = out[0] if splits == 1 else out.sum(0)
    if bias is not None:
        y = y + bias
    return y.to(dtype).view(*lead, n)


def scaled_mm_block_fp8(
    x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``torch._scaled_mm`` with PyTorch's blockwise recipe: ``x`` [M, K] quantized per
    token per 128 channels (scales [M, K/128], M-major), ``w`` [N, K] with 128x128 block
    scales [N/128, K/128]. CUDA (Hopper) only; K and N must be multiples of 128. Raises
    whatever PyTorch raises where the recipe is not supported."""
    from pdserve.kernels.reference import quantize_fp8_groups

    x_q, x_scale = quantize_fp8_groups(x)
    scale_a = x_scale.t().contiguous().t()  # M-major ("outer-dim-major") layout
    return torch._scaled_mm(
        x_q, w.t(), scale_a=scale_a, scale_b=w_scale_inv.float().t(), out_dtype=out_dtype
    )
