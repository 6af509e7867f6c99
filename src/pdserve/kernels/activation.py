"""SwiGLU's gate in one kernel: ``out = silu(x[:, :I]) * x[:, I:]``.

Numerics match :class:`pdserve.layers.activation.SiluAndMul` (torch's ops, as
Hugging Face computes them): ``silu`` in float32 rounded to the input dtype,
then the product rounded once more. The input is the merged gate/up GEMM output
[T, 2I] (gate first); the torch form launches three kernels (silu, a slice
copy-free view, mul), this one launches one. Grid: (rows, column blocks); no
host syncs.

FP8 output mode (:func:`silu_and_mul_fp8`, for a block-FP8 ``down_proj``): each
program quantizes its rounded product per 128-column group (a 1024-column program
holds eight whole groups) and writes float8_e4m3fn values and float32 scales, an
:class:`~pdserve.kernels.reference.Fp8Activation`, instead of the ``x.dtype`` output.
:func:`quantize_fp8` is the same quantization of a plain activation, for a block-FP8
GEMM whose input has no quantizing producer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import (
    check_device,
    group_tile,
    interpret_mode,
    pdl_args,
    pdl_enter,
    rows_2d,
    store_fp8_groups,
)
from pdserve.kernels.reference import (
    FP8_GROUP,
    FP8_MAX,
    Fp8Activation,
    quantize_fp8_activation,
    silu_and_mul_torch,
)


@triton.jit
def silu_mul_values(g, u):
    """``silu(g) * u`` of loaded tiles, rounded as the torch ops round (silu to ``g``'s
    dtype, then the product), as float32."""
    dt = g.dtype
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
    return (s * u.to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def _silu_mul(x_ptr, cols, mask, n_cols):
    """The rounded ``silu(gate) * up`` at ``cols`` of one row (any tile shape), float32."""
    g = tl.load(x_ptr + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + n_cols + cols, mask=mask, other=0.0)
    return silu_mul_values(g, u)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    qs_ptr,
    stride_x,
    stride_o,
    stride_qs,
    n_cols,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr = False,
    QMAX: tl.constexpr = 448.0,
    ROUND_FIRST: tl.constexpr = False,
    GROUP: tl.constexpr = 128,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if QUANT:  # fp8 out: the rounded product quantized per 128-column group
        groups, cols, mask = group_tile(
            tl.program_id(1) * (BLOCK // GROUP), BLOCK // GROUP, GROUP, n_cols
        )
        store_fp8_groups(out_ptr + row * stride_o, qs_ptr + row * stride_qs,
                         _silu_mul(x_row, cols, mask, n_cols), groups, cols, mask, n_cols,
                         QMAX, ROUND_FIRST, GROUP)  # fmt: skip
    else:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _silu_mul(x_row, cols, mask, n_cols)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, qs_ptr, stride_x, stride_q, stride_qs, n_cols,
    BLOCK: tl.constexpr,
    QMAX: tl.constexpr = 448.0,
    ROUND_FIRST: tl.constexpr = False,
    GROUP: tl.constexpr = 128,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    groups, cols, mask = group_tile(
        tl.program_id(1) * (BLOCK // GROUP), BLOCK // GROUP, GROUP, n_cols
    )
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    store_fp8_groups(q_ptr + row * stride_q, qs_ptr + row * stride_qs, x, groups, cols, mask,
                     n_cols, QMAX, ROUND_FIRST, GROUP)  # fmt: skip


def quantize_fp8(x: torch.Tensor) -> Fp8Activation:
    """``x`` [..., K] quantized per token per 128 channels in one launch (what
    :func:`~pdserve.kernels.reference.quantize_fp8_activation` gives): for a block-FP8
    GEMM whose input has no quantizing producer."""
    check_device(x, "quantize_fp8")
    k = x.shape[-1]
    x2 = rows_2d(x)
    act = Fp8Activation.empty(x.shape, x.dtype, x.device)
    rows = x2.shape[0]
    if rows:
        q2, s2 = act.q.view(-1, k), act.scale.view(rows, -1)
        block = 1024  # eight whole groups a program
        _quantize_kernel[(rows, triton.cdiv(k, block))](
            x2, q2, s2, x2.stride(0), q2.stride(0), s2.stride(0), k,
            BLOCK=block, QMAX=FP8_MAX, ROUND_FIRST=interpret_mode(), GROUP=FP8_GROUP,
            num_warps=4, **pdl_args(x2.device),
        )  # fmt: skip
    return act


def _launch(x: torch.Tensor, out: torch.Tensor, out_scale: torch.Tensor | None) -> None:
    check_device(x, "silu_and_mul")
    d = x.shape[-1] // 2
    x2 = rows_2d(x)
    o2 = out.view(-1, d)
    rows = x2.shape[0]
    if rows == 0:
        return
    s2 = out_scale.view(rows, -1) if out_scale is not None else o2
    block = 1024  # a multiple of the 128-column group: no group straddles two programs
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
        x2,
        o2,
        s2,
        x2.stride(0),
        o2.stride(0),
        s2.stride(0),
        d,
        BLOCK=block,
        QUANT=out_scale is not None,
        QMAX=FP8_MAX,
        ROUND_FIRST=interpret_mode(),
        GROUP=FP8_GROUP,
        num_warps=4,
        **pdl_args(x2.device),
    )


def _half_width(x: torch.Tensor) -> int:
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    return x.shape[-1] // 2


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x`` [..., 2I] laid out gate|up; returns [..., I]."""
    d = _half_width(x)
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    _launch(x, out, None)
    return out


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Activation:
    """:func:`silu_and_mul` in the fp8 output mode: the ``x.dtype`` product quantized per
    token per 128 channels in the same pass (float8_e4m3fn values, float32 scales)."""
    act = Fp8Activation.empty((*x.shape[:-1], _half_width(x)), x.dtype, x.device)
    _launch(x, act.q, act.scale)
    return act


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The model's torch form (:class:`pdserve.layers.activation.SiluAndMul`)."""
    return silu_and_mul_torch(x)


def silu_and_mul_fp8_reference(x: torch.Tensor) -> Fp8Activation:
    """The torch form's output, quantized per token per 128 channels."""
    return quantize_fp8_activation(silu_and_mul_torch(x))
