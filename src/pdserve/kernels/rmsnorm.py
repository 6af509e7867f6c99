"""RMSNorm and fused residual-add + RMSNorm, one row per program.

Numerics match :mod:`pdserve.layers.norm` (Hugging Face Llama, and vLLM's CUDA
kernel) bit for bit on the compiled path:

- fused: ``residual_out = x + residual`` rounded to the input dtype (the add
  the unfused model does), and the norm is taken of that rounded sum;
- statistics in float32: ``xn = z * rsqrt(mean(z^2) + eps)``;
- ``xn`` is rounded to the input dtype *before* the weight multiply, and the
  product is rounded once more: ``out = dtype(dtype(xn) * weight)``.

Outputs have ``x.dtype``; ``weight`` should have it too (as in the model).
In-place use is safe (``out=x``, ``residual_out=residual``): a program reads its
whole row before it writes. No host syncs; the grid is the number of rows.

FP8 output mode (:func:`rmsnorm_fp8`, :func:`fused_add_rmsnorm_fp8`): for a block-FP8
linear consumer, the program quantizes its rounded output row per 128-column group
(``scale = max(amax / 448, 1e-12)``, the values
:func:`~pdserve.kernels.reference.quantize_fp8_groups` gives) and writes float8_e4m3fn
values plus float32 scales [rows, ceil(hidden/128)] instead of the ``x.dtype`` output
(``keep_hp``: as well as it, for a producer that also feeds the MoE router or the DSA
indexer), as an :class:`~pdserve.kernels.reference.Fp8Activation`; the residual output
is unchanged. The GEMM then loads fp8 instead of quantizing every x tile once per N tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import (
    check_device,
    group_tile,
    interpret_mode,
    next_pow2,
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
    rms_norm,
)


@triton.jit
def rms_output(z, rstd, w, like):
    """RMSNorm's output from its float32 input ``z`` (the rounded sum where a residual is
    added), ``rstd`` and the float32 weight: ``dtype(dtype(z * rstd) * w)`` in ``like``'s
    dtype (the module doc's rounding)."""
    dt = like.dtype
    return ((z * rstd).to(dt).to(tl.float32) * w).to(dt)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    r_out_ptr,
    q_ptr,
    qs_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    stride_q,
    stride_qs,
    n_cols,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr = False,
    KEEP_HP: tl.constexpr = False,
    QMAX: tl.constexpr = 448.0,
    ROUND_FIRST: tl.constexpr = False,
    GROUP: tl.constexpr = 128,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        z = (xf + r).to(dt)
        xf = z.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    rstd = tl.rsqrt(var + eps)
    if QUANT:  # fp8 out: the rounded output quantized per 128-column group
        # The row read again as [groups, 128] (from L1/L2; nothing is written yet, so
        # in-place use stays safe), through the same elementwise ops: the same rounded
        # output values, with no 1-D -> 2-D reshape (a layout change through shared
        # memory: H100 runs 77 and 85, the quantizing norm took ~5x the plain one's time)
        groups, c2, m2 = group_tile(0, BLOCK // GROUP, GROUP, n_cols)
        z2 = tl.load(x_ptr + row * stride_x + c2, mask=m2, other=0.0).to(tl.float32)
        if HAS_RES:
            r2 = tl.load(r_ptr + row * stride_r + c2, mask=m2, other=0.0).to(tl.float32)
            z2 = (z2 + r2).to(dt).to(tl.float32)
        w2 = tl.load(w_ptr + c2, mask=m2, other=0.0).to(tl.float32)
        y2 = rms_output(z2, rstd, w2, x).to(tl.float32)
        store_fp8_groups(q_ptr + row * stride_q, qs_ptr + row * stride_qs, y2, groups, c2, m2,
                         n_cols, QMAX, ROUND_FIRST, GROUP)  # fmt: skip
        # every thread's [groups, 128] loads before any 1-D store below, which may write
        # an element another thread loaded (in-place use: out=x, residual_out=residual)
        tl.debug_barrier()
    if HAS_RES:
        tl.store(r_out_ptr + row * stride_ro + cols, z, mask=mask)
    if KEEP_HP or not QUANT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, rms_output(xf, rstd, w, x), mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    fp8: Fp8Activation | None = None,
) -> None:
    """``fp8`` given: the fp8 output mode writes its ``q`` and ``scale`` (and ``out``
    too where given: both outputs)."""
    check_device(x, "rmsnorm")
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    x2 = rows_2d(x)
    rows = x2.shape[0]
    q2 = fp8.q.view(-1, n) if fp8 is not None else x2
    s2 = fp8.scale.view(rows, -1) if fp8 is not None else x2
    o2 = out.view(-1, n) if out is not None else q2
    r2 = rows_2d(residual) if residual is not None else x2
    ro2 = residual_out.view(-1, n) if residual_out is not None else o2
    if rows == 0:
        return
    quant = fp8 is not None
    block = max(next_pow2(n), FP8_GROUP) if quant else next_pow2(n)
    warps = min(16, max(1, block // 512))
    _rmsnorm_kernel[(rows,)](
        x2,
        r2,
        weight,
        o2,
        ro2,
        q2,
        s2,
        x2.stride(0),
        r2.stride(0),
        o2.stride(0),
        ro2.stride(0),
        q2.stride(0),
        s2.stride(0),
        n,
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        QUANT=quant,
        KEEP_HP=quant and out is not None,
        QMAX=FP8_MAX,
        ROUND_FIRST=interpret_mode(),
        GROUP=FP8_GROUP,
        num_warps=warps,
        **pdl_args(x2.device),
    )


def rmsnorm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, keep_hp: bool = False
) -> Fp8Activation:
    """:func:`rmsnorm` in the fp8 output mode: the ``x.dtype`` output quantized per token
    per 128 channels in the same pass (fp8 values and float32 scales); ``keep_hp``: the
    ``x.dtype`` output written too (the activation's ``hp``)."""
    act = Fp8Activation.empty(x.shape, x.dtype, x.device, keep_hp)
    _launch(x, None, weight, eps, act.hp, None, act)
    return act


def fused_add_rmsnorm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual_out: torch.Tensor | None = None,
    keep_hp: bool = False,
) -> tuple[Fp8Activation, torch.Tensor]:
    """:func:`fused_add_rmsnorm` in the fp8 output mode: ``(fp8 norm, x + residual)``
    (``keep_hp`` as in :func:`rmsnorm_fp8`)."""
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    act = Fp8Activation.empty(x.shape, x.dtype, x.device, keep_hp)
    _launch(x, residual, weight, eps, act.hp, residual_out, act)
    return act, residual_out


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` [..., hidden]."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) * weight, x + residual)``; pass ``out=x,
    residual_out=residual`` to update in place (vLLM's ``fused_add_rms_norm``)."""
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm (:func:`pdserve.kernels.reference.rms_norm`)."""
    return rms_norm(x, weight, eps)


def fused_add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's fused form: ``z = x + residual`` (input dtype), ``(norm(z), z)``."""
    z = x + residual
    return rms_norm(z, weight, eps), z


def rmsnorm_fp8_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, keep_hp: bool = False
) -> Fp8Activation:
    """The model's RMSNorm output (``x.dtype``), then quantized per token per 128 channels."""
    return quantize_fp8_activation(rms_norm(x, weight, eps), keep_hp)


def fused_add_rmsnorm_fp8_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, keep_hp: bool = False
) -> tuple[Fp8Activation, torch.Tensor]:
    """:func:`fused_add_rmsnorm_reference` with its norm quantized (fp8 output mode)."""
    out, z = fused_add_rmsnorm_reference(x, residual, weight, eps)
    return quantize_fp8_activation(out, keep_hp), z
