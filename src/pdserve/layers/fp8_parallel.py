"""Block-FP8 linears split over tensor-parallel ranks, and the swap of a model's linears
for their FP8 counterparts.

Each split takes whole 128x128 weight blocks, so a rank's FP8 weight and its slice of
``weight_scale_inv`` are exactly that part of the full layer's (and quantizing a rank's
slice of a bf16 weight gives that part of the full weight's quantization):

- :class:`Fp8ColumnParallelLinear`: rank r holds rows ``[r n, (r+1) n)`` of the weight
  and block rows ``[r n/128, (r+1) n/128)`` of the scales;
- :class:`Fp8RowParallelLinear`: columns ``[r k, (r+1) k)`` and block columns
  ``[r k/128, (r+1) k/128)``; a rank's input slice starts on a 128-channel boundary, so
  the per-token activation groups are the full layer's too (one all-reduce after), and
  an :class:`~pdserve.kernels.reference.Fp8Activation` its producer quantized on this
  rank (SiLU-and-mul over the rank's intermediate slice) has the same groups;
- :class:`Fp8MergedColumnParallelLinear`: each part (q, k, v; gate, up) split on its
  own, as the plain merged layer splits them.

A split that would cut a block (``n``, ``k`` or a part's share not a multiple of 128) is
refused when the layer is built, with a message naming the layer, its size and the TP
size (:func:`check_fp8_split`). With a size-1 group each class is its plain FP8
counterpart (unaligned merged parts keep per-row scales, see :mod:`pdserve.layers.fp8`).

:func:`convert_linears` swaps a model's :class:`~pdserve.layers.linear.Linear` layers
(plain, merged or tensor-parallel) for these, allocated on the target device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from pdserve.distributed.groups import Group
from pdserve.kernels.reference import FP8_GROUP, Fp8Activation
from pdserve.layers.fp8 import Fp8Linear, Fp8MergedLinear
from pdserve.layers.linear import Entries, Linear, MergedLinear, Shard, is_plain_linear
from pdserve.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    rank_shard,
    reduce_row_parallel,
)


def check_fp8_split(layer: str, what: str, size: int, tp: Group) -> None:
    """Refuse a tensor-parallel split of ``size`` that does not give each rank whole
    128-wide FP8 blocks (``layer``: the module path, ``what``: the dimension split)."""
    if tp.size == 1 or (size % tp.size == 0 and (size // tp.size) % FP8_GROUP == 0):
        return
    share = f"{size // tp.size}" if size % tp.size == 0 else f"{size / tp.size:g}"
    raise ValueError(
        f"FP8 weights with --tensor-parallel-size {tp.size}: {layer or 'a linear layer'} "
        f"splits {what} ({size}) into {share} per rank, which is not a multiple of the "
        f"{FP8_GROUP}x{FP8_GROUP} weight-scale block; choose a tensor-parallel size that "
        f"leaves each rank a multiple of {FP8_GROUP}, or load the model without FP8"
    )


def _split_entries(
    layer: Fp8Linear, prefix: str, axis: int, tp: Group, *, bias_split: bool
) -> Entries:
    """A split FP8 linear's checkpoint entries: the rank's slice of the weight along
    ``axis`` (0: output rows, 1: input columns) and the matching slice of the block
    scales; the bias split with the rows, or whole on every rank."""
    part = rank_shard(axis, layer.weight.shape[axis], tp)
    blocks = rank_shard(axis, layer.weight_scale_inv.shape[axis], tp)
    out: Entries = {
        prefix + "weight": (layer.weight.data, part),
        prefix + "weight_scale_inv": (layer.weight_scale_inv.data, blocks),
    }
    if layer.bias is not None:
        out[prefix + "bias"] = (layer.bias.data, part if bias_split else None)
    return out


class Fp8ColumnParallelLinear(Fp8Linear):
    """:class:`~pdserve.layers.parallel_linear.ColumnParallelLinear` with block-FP8
    weights (see the module docstring)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        tp: Group | None = None,
        layer: str = "",
    ) -> None:
        group = tp or Group()
        check_fp8_split(layer, "the output features", out_features, group)
        super().__init__(in_features, out_features // group.size, bias, dtype)
        self.tp = group
        self.full_out_features = out_features

    def tensor_entries(self, prefix: str) -> Entries:
        return _split_entries(self, prefix, 0, self.tp, bias_split=True)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.tp.rank}/{self.tp.size}"


class Fp8RowParallelLinear(Fp8Linear):
    """:class:`~pdserve.layers.parallel_linear.RowParallelLinear` with block-FP8 weights
    (see the module docstring); ``reduce_results`` as there."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        tp: Group | None = None,
        reduce_results: bool = True,
        layer: str = "",
    ) -> None:
        group = tp or Group()
        check_fp8_split(layer, "the input features", in_features, group)
        super().__init__(in_features // group.size, out_features, bias, dtype)
        self.tp = group
        self.full_in_features = in_features
        self.reduce_results = reduce_results

    def gemm(
        self, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None, **prologue: object
    ) -> torch.Tensor:
        if self.tp.size == 1:
            return super().gemm(x, bias, **prologue)
        partial = super().gemm(x, None, **prologue)
        return reduce_row_parallel(partial, bias, self.tp, self.reduce_results)

    def tensor_entries(self, prefix: str) -> Entries:
        return _split_entries(self, prefix, 1, self.tp, bias_split=False)  # bias: whole

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.tp.rank}/{self.tp.size}"


class Fp8MergedColumnParallelLinear(Fp8MergedLinear):
    """:class:`~pdserve.layers.parallel_linear.MergedColumnParallelLinear` with block-FP8
    weights: rank r holds each part's r-th slice of rows and of scale block rows."""

    def __init__(
        self,
        in_features: int,
        parts: Mapping[str, int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        tp: Group | None = None,
        layer: str = "",
    ) -> None:
        group = tp or Group()
        for part, size in parts.items():
            check_fp8_split(layer, f"the output features of {part}", size, group)
        local = {part: size // group.size for part, size in parts.items()}
        super().__init__(in_features, local, bias, dtype)
        self.tp = group
        self.full_parts = dict(parts)

    def part_shards(self) -> dict[str, Shard]:
        out: dict[str, Shard] = {}
        for part, size in self.parts.items():
            rows = rank_shard(0, size, self.tp)
            if rows is None:
                continue
            out[f"{part}.weight"] = rows
            blocks = rank_shard(0, size // FP8_GROUP, self.tp)  # whole blocks (checked)
            assert blocks is not None
            out[f"{part}.weight_scale_inv"] = blocks
            if self.bias is not None:
                out[f"{part}.bias"] = rows
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.tp.rank}/{self.tp.size}"


def fp8_counterpart(name: str, module: Linear) -> Fp8Linear:
    """The empty FP8 layer that replaces ``module`` (named ``name``), on the current
    device; a ValueError naming the layer where its TP split cuts FP8 blocks."""
    bias = module.bias is not None
    dtype = module.bias.dtype if module.bias is not None else None
    if isinstance(module, MergedColumnParallelLinear):
        return Fp8MergedColumnParallelLinear(
            module.in_features, module.full_parts, bias, dtype, module.tp, name
        )
    if isinstance(module, MergedLinear):
        return Fp8MergedLinear(module.in_features, module.parts, bias, dtype)
    if isinstance(module, ColumnParallelLinear):
        return Fp8ColumnParallelLinear(
            module.in_features, module.full_out_features, bias, dtype, module.tp, name
        )
    if isinstance(module, RowParallelLinear):
        return Fp8RowParallelLinear(
            module.full_in_features,
            module.out_features,
            bias,
            dtype,
            module.tp,
            module.reduce_results,
            name,
        )
    return Fp8Linear(module.in_features, module.out_features, bias, dtype)


def convert_linears(
    root: nn.Module,
    quantize: Callable[[str, nn.Module], bool],
    device: torch.device | None = None,
) -> list[str]:
    """Replace every :class:`Linear` of ``root`` not FP8 already for which ``quantize(name,
    module)`` holds with its empty FP8 counterpart (:func:`fp8_counterpart`) on ``device``
    (default: where the replaced weight is; a layer built on the meta device costs nothing
    to replace); returns the names replaced."""
    names = [
        name
        for name, module in root.named_modules()
        if is_plain_linear(module) and quantize(name, module)
    ]  # names only: each replaced layer's weights are freed as soon as it is swapped
    for name in names:
        module = root.get_submodule(name)
        assert isinstance(module, Linear)
        with torch.device(device if device is not None else module.weight.device):
            new = fp8_counterpart(name, module)
        parent_name, _, leaf = name.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, leaf, new)
        del module
    return names
