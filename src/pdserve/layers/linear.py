"""Linear layers whose parameters come from a checkpoint, and the routing of HF names to them.

Parameters are allocated with ``torch.empty`` (never initialised: the loader
overwrites every one and refuses a checkpoint that misses any), on whatever
device is current, so a model built under ``with torch.device("cuda")`` holds one
copy of its weights on the GPU and nothing on the host.

A :class:`MergedLinear` stacks several HF projections of the same input along
the output dimension (q|k|v, gate|up) so one GEMM replaces several; it keeps the
HF names of its parts so a checkpoint loads into it unchanged.

Tensor parallelism (:mod:`pdserve.layers.parallel_linear`) builds on two hooks here:
a :class:`Shard` says which part of a full checkpoint tensor a rank holds, and a module
may list its own checkpoint entries (``tensor_entries``: HF name -> (the tensor to copy
into, its shard)) where its parameters are not plain copies of checkpoint tensors.

Deferred weights (:func:`deferred_weights`): a model built inside it gets its linears'
parameters (and the routed experts' stacks, :func:`empty_weight`) on the meta device,
everything else (norms, embeddings, rotary tables) on the current device. The loader
then swaps the linears that become FP8 for FP8 layers allocated on the target device and
:func:`materialize` allocates the rest, so a model that ends up FP8 never holds its
linears in the model dtype (the load-time peak is the FP8 model, not the bf16 one).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shard:
    """The part of a full checkpoint tensor one tensor-parallel rank holds: indices
    ``[start, stop)`` along ``dim``, of ``full`` (the loader reads only these)."""

    dim: int
    start: int
    stop: int
    full: int  # the full tensor's size along ``dim``

    def index(self) -> tuple[slice, ...]:
        """The subscript selecting the shard (for safetensors' ``get_slice``)."""
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """The shard of ``full`` (a view)."""
        return full.narrow(self.dim, self.start, self.stop - self.start)


Entries = dict[str, tuple[torch.Tensor, Shard | None]]


_DEFERRED: ContextVar[bool] = ContextVar("pdserve_deferred_weights", default=False)


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Inside: :func:`empty_weight` allocates on the meta device (see the module doc)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def empty_weight(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    """An uninitialised parameter on the current device, or on the meta device inside
    :func:`deferred_weights` (for a layer whose weights may yet become FP8)."""
    device = torch.device("meta") if _DEFERRED.get() else None
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def materialize(root: nn.Module, device: torch.device) -> int:
    """Give every parameter of ``root`` still on the meta device uninitialised storage on
    ``device`` (a parameter shared by two modules stays one); returns how many. Nothing
    to do when ``device`` is the meta device."""
    if device.type == "meta":
        return 0
    done: dict[int, nn.Parameter] = {}
    for module in root.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in done:
                empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                done[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
            module._parameters[name] = done[id(param)]
    return len(done)


SKINNY_ENV = "PDSERVE_SKINNY_ROWS"
# block-FP8 linears take the decode-size GEMM (weight-only) at one row by default: FP8
# llama-8b-shape at batch 1 x 1K, 3.84 ms a graph replay against 3.98 and 3.89 against
# 4.04 ms a step with one in flight (303 kernels a step against 431: SiLU-and-mul folded
# into down's prologue, no split-K sums); at 16 and 64 rows it was slower
# (5.94 / 8.42 ms of kernels against 4.61 / 7.03, H100, RESULTS.md run 131)
FP8_SKINNY_ROWS = 1


def enable_skinny(root: nn.Module, default: int) -> int:
    """Let the linears under ``root`` run the decode-size GEMM
    (:mod:`pdserve.kernels.skinny_gemm`) for up to ``default`` rows instead of cuBLAS,
    where the fused kernels are on: plain ones in the model dtype; block-FP8 ones (its
    weight-only mode) up to :data:`FP8_SKINNY_ROWS` rows, or as many as
    ``PDSERVE_SKINNY_ROWS`` asks. ``PDSERVE_SKINNY_ROWS`` overrides ``default`` (0:
    never). A model family calls it once its layers are final
    (``CausalLM.configure_decode``) with the rows it measured a gain at; returns the most
    rows any linear takes."""
    from pdserve.layers.fused import use_fused_kernels

    mode = os.environ.get(SKINNY_ENV)
    if mode is not None and not mode.isdigit():
        raise ValueError(f"{SKINNY_ENV} must be a number of rows (got {mode!r})")
    device = next((p.device for p in root.parameters()), None)  # not the default device
    rows = (default if mode is None else int(mode)) if use_fused_kernels(device) else 0
    most = 0
    for module in root.modules():
        if not isinstance(module, Linear):
            continue
        if is_plain_linear(module):
            dtype = module.weight.dtype
            module.skinny_rows = rows if dtype in (torch.bfloat16, torch.float16, torch.float32) else 0
        else:  # block-FP8
            module.skinny_rows = rows if mode is not None else min(rows, FP8_SKINNY_ROWS)
        most = max(most, module.skinny_rows)
    return most


class Linear(nn.Module):
    """``y = x W^T + b`` with ``weight`` [out_features, in_features] and optional ``bias``.

    Up to ``skinny_rows`` rows (decode batches) it runs
    :func:`~pdserve.kernels.skinny_gemm.skinny_gemm`, which can also take the layer's
    producer as a prologue (:func:`norm_then_linear`, :func:`silu_then_linear`)."""

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
        self.weight = empty_weight(out_features, in_features, dtype=dtype)
        self.bias = empty_weight(out_features, dtype=dtype) if bias else None
        self.skinny_rows = 0  # see enable_skinny

    def takes_skinny(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows go through the decode-size GEMM."""
        return 0 < x.numel() <= self.skinny_rows * x.shape[-1]

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None, **prologue: object) -> torch.Tensor:
        """``prologue(x) W^T + bias``: the decode-size GEMM where :meth:`takes_skinny`,
        else torch's (no prologue then)."""
        if self.takes_skinny(x):
            from pdserve.kernels.skinny_gemm import skinny_gemm

            out: Any = skinny_gemm(x, self.weight, bias, **prologue)  # type: ignore[arg-type]
            return out  # a (y, residual) pair under the rmsnorm prologue with a residual
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.bias)

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

    def part_shards(self) -> dict[str, Shard]:
        """HF-relative names -> the shard each view holds (none: whole parts)."""
        return {}

    def tensor_entries(self, prefix: str) -> Entries:
        """The parts under the parent's prefix (``a.qkv_proj.`` lists ``a.q_proj.weight``)."""
        parent = prefix.removesuffix(".").rpartition(".")[0]
        parent = f"{parent}." if parent else ""
        shards = self.part_shards()
        return {parent + n: (v, shards.get(n)) for n, v in self.part_views().items()}

    def extra_repr(self) -> str:
        return f"in={self.in_features}, parts={self.parts}, bias={self.bias is not None}"


def checkpoint_entries(root: nn.Module) -> Entries:
    """Every HF checkpoint name of ``root`` -> (the tensor its values are copied into,
    the :class:`Shard` of the full tensor it holds, None when whole), in named-module order.

    Plain parameters keep their own names; a module with ``tensor_entries(prefix)`` lists
    its own (a :class:`MergedLinear` named ``a.qkv_proj`` lists ``a.q_proj.weight`` etc.).
    A parameter shared by two modules (tied embeddings) is listed once, under the first
    module that owns it. Non-persistent buffers (rotary tables) are not checkpoint tensors.
    """
    entries: Entries = {}
    seen: set[int] = set()
    for mod_name, module in root.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        own = getattr(module, "tensor_entries", None)
        if own is not None:
            params = [id(p) for p in module.parameters(recurse=False)]
            if any(i in seen for i in params):  # tied to a module listed before
                continue
            seen.update(params)
            entries.update(own(prefix))
            continue
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            entries[prefix + p_name] = (param.data, None)
    return entries


def checkpoint_targets(root: nn.Module) -> dict[str, torch.Tensor]:
    """Every HF checkpoint name of ``root`` → the tensor its values are copied into
    (:func:`checkpoint_entries` without the shards)."""
    return {name: t for name, (t, _) in checkpoint_entries(root).items()}


def checkpoint_shards(root: nn.Module) -> dict[str, Shard]:
    """The checkpoint names of ``root`` that this rank holds only a part of."""
    return {name: s for name, (_, s) in checkpoint_entries(root).items() if s is not None}


def _skinny_target(linear: nn.Module, x: torch.Tensor) -> Linear | None:
    """``linear`` where its decode-size GEMM takes ``x``'s rows (a plain or a block-FP8
    linear: the FP8 one then reads its weights with the activation unquantized)."""
    if isinstance(linear, Linear) and linear.takes_skinny(x):
        return linear
    return None


def _folds(prologue: str, x: torch.Tensor) -> bool:
    from pdserve.kernels.skinny_gemm import prologue_pays

    return prologue_pays(x.numel() // x.shape[-1], prologue)


def norm_then_linear(
    norm: nn.Module, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(x + residual)), x + residual)`` (``residual`` None: ``linear(norm(x))``
    and ``x``). Where ``linear``'s decode-size GEMM takes ``x``'s rows, the norm's FP8
    output mode (for an FP8 ``linear``'s other batches) is bypassed, and a fused RMSNorm
    folds into the GEMM's launch where that pays
    (:func:`~pdserve.kernels.skinny_gemm.prologue_pays`); else the norm's kernel, then
    the linear. ``linear`` is a plain or column-parallel one (a normed input is whole on
    every rank)."""
    target = _skinny_target(linear, x)
    if target is not None and getattr(norm, "fused", False) and _folds("rmsnorm", x):
        kw = {"prologue": "rmsnorm", "norm_weight": norm.weight, "eps": norm.eps}
        out: Any = target.gemm(x, target.bias, residual=residual, **kw)
        return (out, x) if residual is None else out
    produce: Any = getattr(norm, "plain", norm) if target is not None else norm
    if residual is None:
        return linear(produce(x)), x
    h, residual = produce(x, residual)
    return linear(h), residual


def silu_then_linear(act: nn.Module, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(act(x))`` for SwiGLU's gate|up output ``x``: where ``linear``'s
    decode-size GEMM takes ``x``'s rows, ``act``'s FP8 output mode is bypassed and
    SiLU-and-mul folds into the GEMM's launch where that pays."""
    target = _skinny_target(linear, x)
    if target is not None and _folds("silu_mul", x):
        return target.gemm(x, target.bias, prologue="silu_mul")
    produce: Any = getattr(act, "plain", act) if target is not None else act
    out: torch.Tensor = linear(produce(x))
    return out


def is_plain_linear(module: nn.Module) -> bool:
    """A :class:`Linear` (merged or tensor-parallel ones too) in the model dtype: what
    FP8 conversion may swap (not FP8 already)."""
    return isinstance(module, Linear) and not getattr(module, "quantized", False)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy ``src`` into ``dst`` (casting dtype and device); a shape mismatch is a ValueError."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"tensor {name!r} has shape {list(src.shape)} but the model expects {list(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)
