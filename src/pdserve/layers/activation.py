"""Activations of gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU's gate (Shazeer, 2020): ``[T, 2I] -> silu(x[:, :I]) * x[:, I:]``.

    The input is the output of a merged gate/up projection: gate first, up second.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
