"""RMSNorm (Zhang & Sennrich, 2019), with the residual add fused in as vLLM does.

Numerics follow Hugging Face Llama: statistics in float32, the normalised value
cast back to the input dtype *before* the weight multiply. The fused form
``norm(x, residual)`` first forms ``residual + x`` in the input dtype (the
unfused decoder does the same add), returns its norm, and hands the sum on as
the next residual.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from pdserve.kernels.reference import Fp8Activation, quantize_fp8_activation, rms_norm
from pdserve.layers.fused import use_fused_kernels

Activation = torch.Tensor | Fp8Activation  # what a producer hands its consumers


class RMSNorm(nn.Module):
    """``y = w * x / rms(x)``; ``weight`` has shape [hidden_size] and is loaded, not initialised.

    ``quant_out`` (off unless set, by
    :func:`~pdserve.models.quantization.fuse_fp8_activations` at load where every
    consumer of the output is a block-FP8 linear): the norm returns an
    :class:`~pdserve.kernels.reference.Fp8Activation` (its output quantized per token
    per 128 channels, in the same kernel where the fused kernels are on) in place of the
    tensor; the residual output is unchanged. ``quant_keep_hp`` (with ``quant_out``):
    the activation carries the ``x.dtype`` output too, as ``hp``, for consumers beside
    the FP8 ones that read it (the MoE router, the DSA indexer); one kernel writes both."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.fused = use_fused_kernels()  # one Triton kernel instead of ~8 torch ops
        self.quant_out = False
        self.quant_keep_hp = False

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> Activation: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[Activation, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> Activation | tuple[Activation, torch.Tensor]:
        """``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given
        (``norm`` an :class:`Fp8Activation` under ``quant_out``)."""
        if self.quant_out:
            return self._forward_fp8(x, residual)
        return self.plain(x, residual)

    def plain(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` in the model dtype, ``quant_out`` aside (for a consumer that
        reads unquantized activations: an FP8 linear's decode-size GEMM)."""
        if self.fused:
            from pdserve.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

            if residual is None:
                return rmsnorm(x, self.weight, self.eps)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x

    def _forward_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> Fp8Activation | tuple[Fp8Activation, torch.Tensor]:
        keep = self.quant_keep_hp
        if self.fused:
            from pdserve.kernels.rmsnorm import fused_add_rmsnorm_fp8, rmsnorm_fp8

            if residual is None:
                return rmsnorm_fp8(x, self.weight, self.eps, keep_hp=keep)
            return fused_add_rmsnorm_fp8(x, residual, self.weight, self.eps, keep_hp=keep)
        if residual is None:
            return quantize_fp8_activation(rms_norm(x, self.weight, self.eps), keep)
        x = x + residual
        return quantize_fp8_activation(rms_norm(x, self.weight, self.eps), keep), x

    def extra_repr(self) -> str:
        fp8 = (", fp8+hp out" if self.quant_keep_hp else ", fp8 out") if self.quant_out else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{fp8}"


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (the DSA indexer's ``k_norm``); loaded, not
    initialised. Computed by torch's ``layer_norm`` (float32 statistics)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
