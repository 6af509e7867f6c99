"""SwiGLU's gate in one kernel: ``out = silu(x[:, :I]) * x[:, I:]``.

Numerics match :class:`pdserve.layers.activation.SiluAndMul` (torch's ops, as
Hugging Face computes them): ``silu`` in float32 rounded to the input dtype,
then the product rounded once more. The input is the merged gate/up GEMM output
[T, 2I] (gate first); the torch form launches three kernels (silu, a slice
copy-free view, mul), this one launches one. Grid: (rows, column blocks); no
host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import check_device


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    dt = g.dtype
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u.to(tl.float32)).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x`` [..., 2I] laid out gate|up; returns [..., I]."""
    check_device(x, "silu_and_mul")
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    d = x.shape[-1] // 2
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    o2 = out.view(-1, d)
    rows = x2.shape[0]
    if rows == 0:
        return out
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
        x2, o2, x2.stride(0), o2.stride(0), d, BLOCK=block, num_warps=4
    )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The model's torch form (:class:`pdserve.layers.activation.SiluAndMul`)."""
    from pdserve.kernels.reference import silu_and_mul_torch

    return silu_and_mul_torch(x)
