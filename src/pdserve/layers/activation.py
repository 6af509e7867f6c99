"""Activations of gated MLPs."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels.reference import Fp8Activation, quantize_fp8_activation, silu_and_mul_torch
from pdserve.layers.fused import use_fused_kernels


class SiluAndMul(nn.Module):
    """SwiGLU's gate (Shazeer, 2020): ``[T, 2I] -> silu(x[:, :I]) * x[:, I:]``.

    The input is the output of a merged gate/up projection: gate first, up second.
    On CUDA (see :mod:`pdserve.layers.fused`) one Triton kernel does it.

    ``quant_out`` (set at load where the consumer is a block-FP8 ``down_proj``, see
    :func:`~pdserve.models.quantization.fuse_fp8_activations`): returns the product
    quantized per token per 128 channels, an
    :class:`~pdserve.kernels.reference.Fp8Activation`, in the same kernel.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fused = use_fused_kernels()
        self.quant_out = False

    def forward(self, x: torch.Tensor) -> torch.Tensor | Fp8Activation:
        if self.quant_out:
            if self.fused:
                from pdserve.kernels.activation import silu_and_mul_fp8

                return silu_and_mul_fp8(x)
            return quantize_fp8_activation(silu_and_mul_torch(x))
        return self.plain(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` in the model dtype, ``quant_out`` aside."""
        if self.fused:
            from pdserve.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        return silu_and_mul_torch(x)

    def extra_repr(self) -> str:
        return "fp8 out" if self.quant_out else ""
