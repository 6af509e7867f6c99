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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm over the last dimension."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """``y = w * x / rms(x)``; ``weight`` has shape [hidden_size] and is loaded, not initialised."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
