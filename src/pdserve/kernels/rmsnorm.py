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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import check_device, next_pow2
from pdserve.kernels.reference import rms_norm


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    r_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        z = (xf + r).to(dt)
        tl.store(r_out_ptr + row * stride_ro + cols, z, mask=mask)
        xf = z.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    xn = (xf * tl.rsqrt(var + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xn * w).to(dt), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """2-D [rows, hidden] view with unit inner stride (copies only if it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    check_device(x, "rmsnorm")
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    x2, o2 = _rows(x), out.view(-1, n)
    r2 = _rows(residual) if residual is not None else x2
    ro2 = residual_out.view(-1, n) if residual_out is not None else o2
    rows = x2.shape[0]
    if rows == 0:
        return
    block = next_pow2(n)
    warps = min(16, max(1, block // 512))
    _rmsnorm_kernel[(rows,)](
        x2,
        r2,
        weight,
        o2,
        ro2,
        x2.stride(0),
        r2.stride(0),
        o2.stride(0),
        ro2.stride(0),
        n,
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        num_warps=warps,
    )


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
