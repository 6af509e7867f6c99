"""Linear layers whose parameters come from a checkpoint, and the routing of HF names to them.

Parameters are allocated with ``torch.empty`` (never initialised: the loader
overwrites every one and refuses a checkpoint that misses any), on whatever
device is current, so a model built under ``with torch.device("cuda")`` holds one
copy of its weights on the GPU and nothing on the host.

A :class:`MergedLinear` stacks several HF projections of the same input along
the output dimension (q|k|v, gate|up) so one GEMM replaces several; it keeps the
HF names of its parts so a checkpoint loads into it unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn


def _empty_param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T + b`` with ``weight`` [out_features, in_features] and optional ``bias``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _empty_param(out_features, in_features, dtype=dtype)
        self.bias = _empty_param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Projections of one input stacked on the output dim, in the order of ``parts``.

    ``parts`` maps each part's HF module name (``"q_proj"``) to its output size;
    the output of the forward is their concatenation in that order.
    """

    def __init__(
        self,
        in_features: int,
        parts: Mapping[str, int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not parts:
            raise ValueError("MergedLinear needs at least one part")
        super().__init__(in_features, sum(parts.values()), bias=bias, dtype=dtype)
        self.parts = dict(parts)

    def part_views(self) -> dict[str, torch.Tensor]:
        """HF-relative names (``"q_proj.weight"``) → views into the merged parameters."""
        views: dict[str, torch.Tensor] = {}
        offset = 0
        for part, size in self.parts.items():
            views[f"{part}.weight"] = self.weight.data[offset : offset + size]
            if self.bias is not None:
                views[f"{part}.bias"] = self.bias.data[offset : offset + size]
            offset += size
        return views

    def extra_repr(self) -> str:
        return f"in={self.in_features}, parts={self.parts}, bias={self.bias is not None}"


def checkpoint_targets(root: nn.Module) -> dict[str, torch.Tensor]:
    """Every HF checkpoint name of ``root`` → the tensor its values are copied into.

    Plain parameters keep their own names; a :class:`MergedLinear` named
    ``a.qkv_proj`` contributes ``a.q_proj.weight`` etc. A parameter shared by two
    modules (tied embeddings) is listed once, under the first module that owns it.
    Non-persistent buffers (rotary tables) are not checkpoint tensors.
    """
    targets: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mod_name, module in root.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, MergedLinear):
            parent = mod_name.rsplit(".", 1)[0] + "." if "." in mod_name else ""
            seen.update(id(p) for p in module.parameters(recurse=False))
            for part_name, view in module.part_views().items():
                targets[parent + part_name] = view
            continue
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            targets[prefix + p_name] = param.data
    return targets


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy ``src`` into ``dst`` (casting dtype and device); a shape mismatch is a ValueError."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"tensor {name!r} has shape {list(src.shape)} but the model expects {list(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)
