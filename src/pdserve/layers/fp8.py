"""Linear layers with block-scaled FP8 weights (DeepSeek-V3 / GLM-5-FP8 checkpoints).

An :class:`Fp8Linear` holds ``weight`` [N, K] in float8_e4m3fn and ``weight_scale_inv``
float32, one value per ``scale_rows`` x 128 block (``w ≈ weight * weight_scale_inv``
block by block), under the checkpoint's own names. Its forward quantizes the input per
token per 128 channels (or takes an :class:`~pdserve.kernels.reference.Fp8Activation`
its producer quantized, see :func:`~pdserve.models.quantization.fuse_fp8_activations`)
and runs the block-FP8 GEMM:

- CUDA: the Triton kernel (:func:`~pdserve.kernels.fp8_gemm.block_fp8_gemm`); with
  ``GLUON_FP8`` on (the default), batches of at least ``GLUON_MIN_TOKENS`` tokens whose
  activations come quantized from their producer run a Gluon tile kernel on
  Hopper (:func:`~pdserve.kernels.fp8_gemm_gluon.fp8_gemm_gluon`, by default its
  warp-specialized persistent schedule: 64-71% of the fp8 peak at 2K-16K tokens on the
  H100, run 130, against 49-61% for the TMA ring, which the H200 measured at 50-57%,
  faster than bf16 cuBLAS and than the Triton kernel at 2K+; ``PDSERVE_FP8_PREFILL``
  picks another; smaller batches keep the Triton kernel, which the Gluon decode kernel
  did not beat, RESULTS.md run 49), a plain input quantized first by one launch
  (:func:`~pdserve.kernels.activation.quantize_fp8`, ``GLUON_QUANTIZE``); or for
  batches of at least ``SCALED_MM_MIN_TOKENS`` tokens ``torch._scaled_mm``'s blockwise
  recipe where this PyTorch and GPU support it (checked once per device against the
  reference, at the first such call; the Triton kernel otherwise, and always while a
  CUDA graph is captured);
- CPU: the dequantize-then-matmul reference (the Triton kernel under
  ``PDSERVE_FUSED_KERNELS=1`` with the interpreter).

A :class:`Fp8MergedLinear` (q|k|v, gate|up) keeps 128-row scale blocks when every part
starts on a 128-row boundary (the published models), and one scale row per weight row
otherwise (small test models): a part's ``[ceil(n/128), K/128]`` checkpoint scales are
then repeated over its rows on load (:func:`expand_scale_rows`), the same values.

:func:`~pdserve.layers.fp8_parallel.convert_linears` swaps a model's :class:`Linear`
layers for these (and tensor-parallel ones for their FP8 counterparts, in
:mod:`pdserve.layers.fp8_parallel`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pdserve.kernels.reference import (
    FP8_DTYPE,
    FP8_GROUP,
    Fp8Activation,
    block_fp8_matmul_reference,
)
from pdserve.layers.fused import use_fused_kernels
from pdserve.layers.linear import Linear, MergedLinear

SCALED_MM_MIN_TOKENS = 256
GLUON_FP8 = True  # the Gluon FP8 tile kernel for prefill-sized batches (module docstring)
GLUON_MIN_TOKENS = 1024
# inputs no producer quantized (o_proj after attention, the DSA indexer's projections)
# take the Gluon kernel too, after one quantizing launch, rather than the Triton kernel
# that quantizes each x tile once per N tile (H100 run 85: 67 ms of an 8K glm5 prefill)
GLUON_QUANTIZE = True


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Linear(Linear):
    """``y = x W^T + b`` with block-scaled FP8 ``weight`` (see the module docstring)."""

    quantized = True  # never converted again (:func:`~pdserve.layers.linear.is_plain_linear`)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        scale_rows: int = FP8_GROUP,
    ) -> None:
        nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        self.scale_rows = scale_rows
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(
                _cdiv(out_features, scale_rows),
                _cdiv(in_features, FP8_GROUP),
                dtype=torch.float32,
            ),
            requires_grad=False,
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self.fused = use_fused_kernels()
        self.skinny_rows = 0  # see enable_skinny (weight-only decode-size GEMM)

    def gemm(
        self, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None, **prologue: object
    ) -> torch.Tensor:
        """Up to ``skinny_rows`` rows of a plain activation: the decode-size GEMM over the
        FP8 weights, weight-only (the activation unquantized; ``prologue`` as for
        :class:`Linear`); else the block-FP8 GEMM (no prologue)."""
        if isinstance(x, torch.Tensor) and self.takes_skinny(x):
            from pdserve.kernels.skinny_gemm import skinny_gemm

            scales = {"weight_scale": self.weight_scale_inv, "scale_rows": self.scale_rows}
            out: Any = skinny_gemm(x, self.weight, bias, **scales, **prologue)  # type: ignore[arg-type]
            return out
        if prologue:
            raise ValueError(f"{type(self).__name__}: a prologue needs the decode-size GEMM")
        return fp8_linear(x, self.weight, self.weight_scale_inv, bias, self.scale_rows, self.fused)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        return self.gemm(x, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 blocks {self.scale_rows}x{FP8_GROUP}"


class Fp8MergedLinear(Fp8Linear, MergedLinear):
    """:class:`MergedLinear` with FP8 weights; each part's HF names (``q_proj.weight``,
    ``q_proj.weight_scale_inv``) are views into the merged parameters."""

    def __init__(
        self,
        in_features: int,
        parts: Mapping[str, int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        aligned = all(size % FP8_GROUP == 0 for size in list(parts.values())[:-1])
        Fp8Linear.__init__(
            self, in_features, sum(parts.values()), bias, dtype, FP8_GROUP if aligned else 1
        )
        self.parts = dict(parts)

    def part_views(self) -> dict[str, torch.Tensor]:
        views = MergedLinear.part_views(self)
        offset = 0
        for part, size in self.parts.items():
            a, b = offset // self.scale_rows, _cdiv(offset + size, self.scale_rows)
            views[f"{part}.weight_scale_inv"] = self.weight_scale_inv.data[a:b]
            offset += size
        return views

    def extra_repr(self) -> str:
        return f"{MergedLinear.extra_repr(self)}, fp8 blocks {self.scale_rows}x{FP8_GROUP}"


def expand_scale_rows(scale: torch.Tensor, rows: int, target_rows: int) -> torch.Tensor:
    """A part's checkpoint scales [ceil(rows/128), kb] as ``target_rows`` scale rows:
    unchanged when they already match, one row per weight row when ``target_rows`` is
    ``rows`` (an unaligned merged layer)."""
    if scale.shape[0] == target_rows:
        return scale
    if target_rows != rows:
        raise ValueError(
            f"weight_scale_inv has {scale.shape[0]} rows; expected {target_rows} "
            f"(or {_cdiv(rows, FP8_GROUP)} for {rows} weight rows in 128-row blocks)"
        )
    return scale.repeat_interleave(FP8_GROUP, 0)[:rows]


def fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    scale_rows: int,
    fused: bool,
) -> torch.Tensor:
    """Dispatch one block-FP8 GEMM (see the module docstring)."""
    if not fused:
        return block_fp8_matmul_reference(x, weight, scale_inv, bias, scale_rows=scale_rows)
    from pdserve.kernels.fp8_gemm import block_fp8_gemm

    tokens = x.shape[:-1].numel()
    if GLUON_FP8 and tokens >= GLUON_MIN_TOKENS:
        from pdserve.kernels import fp8_gemm_gluon as g

        if g.supported(x, weight, scale_rows, None, x.dtype, quantizable=GLUON_QUANTIZE):
            if not isinstance(x, Fp8Activation):
                from pdserve.kernels.activation import quantize_fp8

                x = quantize_fp8(x)
            out = g.fp8_gemm_gluon(x, weight, scale_inv, scale_rows, x.dtype)
            return out + bias if bias is not None else out
    if tokens >= SCALED_MM_MIN_TOKENS and _scaled_mm_usable(x, weight, scale_rows):
        from pdserve.kernels.fp8_gemm import scaled_mm_block_fp8

        flat = x if isinstance(x, Fp8Activation) else x.reshape(-1, x.shape[-1])
        out = scaled_mm_block_fp8(flat, weight, scale_inv, x.dtype)
        out = out.view(*x.shape[:-1], weight.shape[0])
        return out + bias if bias is not None else out
    return block_fp8_gemm(x, weight, scale_inv, scale_rows, bias)


def _scaled_mm_usable(
    x: torch.Tensor | Fp8Activation, weight: torch.Tensor, scale_rows: int
) -> bool:
    n, k = weight.shape
    if x.device.type != "cuda" or scale_rows != FP8_GROUP or n % FP8_GROUP or k % FP8_GROUP:
        return False
    if torch.cuda.is_current_stream_capturing():  # graphs (decode batches) use Triton
        return False
    return _check_scaled_mm(x.device, x.dtype)


@functools.lru_cache(maxsize=8)
def _check_scaled_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm``'s blockwise recipe runs here and matches the reference
    (asked once per device and dtype)."""
    from pdserve.kernels.fp8_gemm import scaled_mm_block_fp8
    from pdserve.kernels.reference import quantize_fp8_blocks

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 256, device=device, generator=gen).to(dtype)
    w, s = quantize_fp8_blocks(torch.randn(256, 256, device=device, generator=gen), (128, 128))
    try:
        got = scaled_mm_block_fp8(x, w, s, dtype).float()
    except Exception:  # whatever this PyTorch build raises for an unsupported recipe
        return False
    want = block_fp8_matmul_reference(x, w, s).float()
    return bool(((got - want).abs().max() <= 2e-2 * want.abs().max()).item())
