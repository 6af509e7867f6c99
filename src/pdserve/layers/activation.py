"""Activations of gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.fused import use_fused_kernels


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """Reference: ``silu(x[..., :I]) * x[..., I:]`` with torch ops."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    """SwiGLU's gate (Shazeer, 2020): ``[T, 2I] -> silu(x[:, :I]) * x[:, I:]``.

    The input is the output of a merged gate/up projection: gate first, up second.
    On CUDA (see :mod:`pdserve.layers.fused`) one Triton kernel does it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fused = use_fused_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from pdserve.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        return silu_and_mul_torch(x)
