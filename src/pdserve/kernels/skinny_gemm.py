"""Linear layers for decode-sized batches (``M <= SKINNY_MAX_M`` rows), with the small
ops around them folded into the GEMM.

A decode step of a dense model is a chain per layer of

    qkv = W_qkv . rmsnorm(h)          o:    h = h + W_o . attn
    gu  = W_gu  . rmsnorm(h)          down: h = h + W_down . (silu(gate) * up)

At a few rows every GEMM is a stream over its weight matrix, and the norms, the
activation and the residual adds are separate launches that each cost a few
microseconds of latency, more than the bytes they move. :func:`skinny_linear` does
each line above in one kernel:

- ``norm_weight``: RMSNorm as a prologue. A program reads the whole input row
  anyway, so it accumulates the row's sum of squares in the same loop and scales
  its output by ``rsqrt(mean + eps)`` at the end (the norm is a per-row scale, so
  it commutes with the GEMM); ``x * norm_weight`` is rounded to the weight dtype
  before the MMA, as the unfused norm's output is.
- ``silu_mul``: ``x`` is the gate|up output [M, 2K]; ``silu(gate) * up`` is
  formed tile by tile and rounded like :mod:`pdserve.kernels.activation`'s.
- ``residual``: added in float32 to the accumulator before the one rounding.

No split-K: each program owns ``BLOCK_N`` output columns for all rows and walks
all of K, so there is no second reduction kernel (cuBLAS picks split-K for the
deep GEMMs at these sizes and adds a reduce launch). Weights are read exactly
once. ``BLOCK_M == 1`` uses a multiply-and-sum on the CUDA cores; larger tiles use
``tl.dot`` with the rows padded to 16 (bandwidth-bound, so the padding is free).

Numerics differ from the unfused chain only in rounding order (the norm's
scale is applied to the fp32 accumulator, the residual add sees the unrounded
product): parity tests compare within a few bf16 ulps, against
:func:`skinny_linear_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import check_device, dot_upcast

SKINNY_MAX_M = 64


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    g_ptr,
    r_ptr,
    y_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_ym,
    eps,
    K: tl.constexpr,
    NORM: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    wdt = w_ptr.dtype.element_ty
    if BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    elif SWAP:  # y^T = W x^T: the weight tile is the MMA's wide operand
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    ss = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K if not EVEN_K else tl.full((BLOCK_K,), 1, tl.int1)
        xm = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
        if SILU:
            u = tl.load(x_rows + K + kk[None, :], mask=xm, other=0.0)
            gf = x.to(tl.float32)
            s = (gf / (1.0 + tl.exp(-gf))).to(wdt).to(tl.float32)
            x = (s * u.to(tl.float32)).to(wdt)
        if NORM:
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            g = tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = (xf * g[None, :]).to(wdt)
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M == 1:
            acc2 += w.to(tl.float32) * x.to(tl.float32)
        elif SWAP:
            if UPCAST:
                acc_t += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)))
            else:
                acc_t += tl.dot(w, tl.trans(x))
        elif UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w))
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    elif SWAP:
        acc = tl.trans(acc_t)
    if NORM:
        acc = acc * tl.rsqrt(ss / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        r_rows = r_ptr + offs_m.to(tl.int64)[:, None] * stride_rm
        acc += tl.load(r_rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    y_rows = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym
    tl.store(y_rows + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


# (BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP) by rows; see choose_config.
_CONFIGS: dict[int, tuple[int, int, int, int, bool]] = {
    1: (8, 512, 4, 3, False),
    16: (64, 128, 4, 4, True),
    64: (64, 128, 4, 4, True),
}

Config = tuple[int, int, int, int, int, bool]


def choose_config(m: int, n: int, k: int) -> Config:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP) for [m, k] x [k, n]."""
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    return (block_m, *_CONFIGS[1 if m == 1 else (16 if block_m <= 16 else 64)])


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """``y = op(x) W^T (+ bias) (+ residual)`` for ``x`` [M, K'] with ``M <= SKINNY_MAX_M``.

    ``op`` is the identity, ``rmsnorm(., norm_weight, eps)``, or (``silu_mul``) SwiGLU
    over ``x`` = gate|up of width ``2 K``. ``weight`` is [N, K] with unit inner stride.
    ``out`` may be ``residual`` itself (each output element is read, then written, by
    one program). ``config`` overrides :func:`choose_config` (benchmarks).
    """
    check_device(x, "skinny_linear")
    if norm_weight is not None and silu_mul:
        raise ValueError("skinny_linear: norm_weight and silu_mul cannot be combined")
    m = x.shape[0]
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} does not fit weight {(n, k)}")
    if m > SKINNY_MAX_M:
        raise ValueError(f"skinny_linear: {m} rows is more than {SKINNY_MAX_M}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_linear needs unit inner strides")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"skinny_linear: residual {tuple(residual.shape)} is not {(m, n)}")
    bm, bn, bk, warps, stages, swap = config or choose_config(m, n, k)
    _skinny_kernel[(triton.cdiv(n, bn),)](
        x,
        weight,
        bias if bias is not None else weight,
        norm_weight if norm_weight is not None else weight,
        residual if residual is not None else out,
        out,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        eps,
        K=k,
        NORM=norm_weight is not None,
        SILU=silu_mul,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SWAP=swap,
        EVEN_K=k % bk == 0,
        UPCAST=dot_upcast(weight.dtype) or weight.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def skinny_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused chain in plain torch (the model's torch path)."""
    from pdserve.layers.activation import silu_and_mul_torch
    from pdserve.layers.norm import rms_norm

    if silu_mul:
        x = silu_and_mul_torch(x)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    y = torch.nn.functional.linear(x, weight, bias)
    if residual is not None:
        y = (y.float() + residual.float()).to(y.dtype)
    return y
