"""Activations of gated MLPs."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels.reference import silu_and_mul_torch
from pdserve.layers.fused import use_fused_kernels


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
