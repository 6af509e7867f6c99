"""Linear layers split over the tensor-parallel (TP) ranks of a :class:`Group`.

Megatron-LM's two splits (Shoeybi et al., 2019), each rank holding one slice of the
weight as it appears in the checkpoint:

- :class:`ColumnParallelLinear`: the output features are split; rank r computes its
  slice of ``y`` (no communication). Its bias is split the same way.
- :class:`RowParallelLinear`: the input features are split; rank r multiplies its slice
  of ``x`` (the output of a column-parallel layer) and the partial sums are added with
  one all-reduce. The bias is added once, after the sum.
- :class:`MergedColumnParallelLinear`: several column-parallel projections of one input
  stacked (q|k|v, gate|up); each HF part is split on its own, so rank r holds
  ``[q_r | k_r | v_r]`` and a checkpoint loads unchanged.

A column-parallel layer followed by a row-parallel one (attention heads then ``o_proj``;
``gate_up`` then ``down``) costs one all-reduce. Sizes must divide evenly:
:func:`tp_divide` refuses others with a message naming the flag and the numbers.

With a size-1 group every class computes exactly what its plain counterpart computes
(same parameters, same arithmetic), so single-process models use them unchanged.
Each layer lists its checkpoint entries with the :class:`~pdserve.layers.linear.Shard`
of the full tensor it holds, so the loader reads only that slice from the file.
Their block-FP8 counterparts are in :mod:`pdserve.layers.fp8_parallel`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pdserve.distributed.groups import Group
from pdserve.layers.linear import Entries, Linear, MergedLinear, Shard


def tp_divide(n: int, tp: Group, what: str) -> int:
    """``n / tp.size``; a ValueError naming ``what`` when it does not divide evenly."""
    if n % tp.size:
        raise ValueError(
            f"--tensor-parallel-size {tp.size} must divide {what} ({n}); choose a size "
            f"that divides it"
        )
    return n // tp.size


def reduce_row_parallel(
    partial: torch.Tensor, bias: torch.Tensor | None, tp: Group, reduce_results: bool
) -> torch.Tensor:
    """A row-parallel layer's output from this rank's partial product (TP size > 1): summed
    over the ranks (or left partial, the bias on rank 0 only), plus the bias once."""
    if reduce_results:
        partial = tp.all_reduce(partial)
    elif tp.rank != 0:
        return partial
    return partial + bias if bias is not None else partial


def rank_shard(dim: int, local: int, tp: Group) -> Shard | None:
    """Rank ``tp.rank``'s block of ``local`` indices along ``dim`` (None: the whole)."""
    if tp.size == 1:
        return None
    return Shard(dim, tp.rank * local, (tp.rank + 1) * local, local * tp.size)


class ColumnParallelLinear(Linear):
    """``y_r = x W_r^T + b_r``: rank r holds rows ``[r n, (r+1) n)`` of W (n = out / tp)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        tp: Group | None = None,
        what: str = "the output features",
    ) -> None:
        group = tp or Group()
        super().__init__(in_features, tp_divide(out_features, group, what), bias, dtype)
        self.tp = group
        self.full_out_features = out_features

    def tensor_entries(self, prefix: str) -> Entries:
        shard = rank_shard(0, self.out_features, self.tp)
        out: Entries = {prefix + "weight": (self.weight.data, shard)}
        if self.bias is not None:
            out[prefix + "bias"] = (self.bias.data, shard)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.tp.rank}/{self.tp.size}"


class RowParallelLinear(Linear):
    """``y = sum_r x_r W_r^T + b``: rank r holds columns ``[r k, (r+1) k)`` of W
    (k = in / tp) and takes its slice ``x_r`` of the input.

    ``reduce_results=False`` leaves the partial sum for the caller to reduce together
    with others (the MoE adds its experts' and shared experts' partials and reduces once);
    the bias, if any, is then added on rank 0 only, so the sum still holds it once.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        tp: Group | None = None,
        what: str = "the input features",
        reduce_results: bool = True,
    ) -> None:
        group = tp or Group()
        super().__init__(tp_divide(in_features, group, what), out_features, bias, dtype)
        self.tp = group
        self.full_in_features = in_features
        self.reduce_results = reduce_results

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None, **prologue: object) -> torch.Tensor:
        if self.tp.size == 1:
            return super().gemm(x, bias, **prologue)
        partial = super().gemm(x, None, **prologue)
        return reduce_row_parallel(partial, bias, self.tp, self.reduce_results)

    def tensor_entries(self, prefix: str) -> Entries:
        out: Entries = {
            prefix + "weight": (self.weight.data, rank_shard(1, self.in_features, self.tp))
        }
        if self.bias is not None:
            out[prefix + "bias"] = (self.bias.data, None)  # whole on every rank
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.tp.rank}/{self.tp.size}"


class MergedColumnParallelLinear(MergedLinear):
    """Column-parallel projections of one input, stacked: rank r holds each part's r-th
    slice, in the order of ``parts`` (full HF output sizes; each must divide by tp).
    ``what`` names each part's size in error messages (part name -> config field)."""

    def __init__(
        self,
        in_features: int,
        parts: Mapping[str, int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        tp: Group | None = None,
        what: Mapping[str, str] | None = None,
    ) -> None:
        group = tp or Group()
        names = what or {}
        local = {
            p: tp_divide(n, group, names.get(p, f"the output size of {p}"))
            for p, n in parts.items()
        }
        super().__init__(in_features, local, bias, dtype)
        self.tp = group
        self.full_parts = dict(parts)

    def part_shards(self) -> dict[str, Shard]:
        out: dict[str, Shard] = {}
        for part, size in self.parts.items():
            shard = rank_shard(0, size, self.tp)
            if shard is None:
                continue
            out[f"{part}.weight"] = shard
            if self.bias is not None:
                out[f"{part}.bias"] = shard
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.tp.rank}/{self.tp.size}"
