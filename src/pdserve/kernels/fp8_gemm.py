"""Block-scaled FP8 GEMM: ``y = x W^T`` with ``W`` in float8_e4m3fn, one scale per block.

Weights: ``w`` [N, K] fp8 and ``w_scale_inv`` float32 [ceil(N / SCALE_N), ceil(K / 128)]
(DeepSeek-V3's layout with ``SCALE_N`` 128; 1 when a merged projection's parts do not
start on 128-row boundaries, see :mod:`pdserve.layers.fp8`). Activations arrive in
bf16/fp16/fp32 and are quantized on the fly, inside the kernel: each program loads a
``[BLOCK_M, 128]`` tile of ``x``, takes each row's absolute maximum over those 128
channels (one scale per token per 128-channel group, as the reference
:func:`~pdserve.kernels.reference.quantize_fp8_groups` does), scales and casts it to fp8
and feeds FP8 tensor-core MMAs; the partial product of each 128-wide K step is
multiplied by the activation and weight scales and accumulated in float32.

Pre-quantized activations: ``x`` may be an
:class:`~pdserve.kernels.reference.Fp8Activation` (fp8 values and their float32 group
scales [M, K/128], written by the producer in its own kernel: the RMSNorm or SiLU-and-mul
fp8 output mode). The kernel then loads the fp8 tile and the tile rows' scale of each K
step instead of loading bf16 and quantizing it; every N-tile program used to repeat that
quantization (and the split-K programs each for their K range). Same values: the
producer quantizes the bf16 output exactly as the kernel would.

Decode batches have few rows, so the N tiles alone cannot occupy the GPU; the K range is
then split over several programs (split-K) whose float32 partials one small kernel adds
up, with the bias, and casts (:func:`splitk_sum`: one launch where torch's ``sum``,
bias add and cast were two or three). Summing them in the GEMM's own launch instead (the
tile's last split adding the stored partials, as :mod:`pdserve.kernels.skinny_gemm`
does) measured no faster at one row and slower from 16 (llama-8b-shape FP8 decode, the
GEMM's kernels a step at 1 / 16 / 64 rows: 2.94 / 3.17 / 5.36 ms against 2.93 / 3.04 /
3.81 with the sum kernel, H100, RESULTS.md run 135): the tile's last program reads every
partial after its own K range, and the 64-row tiles (64 x 256) hold two accumulators.
The grid depends only on shapes (no host sync), so the launch can be captured in a CUDA
graph.

Tile configuration: :class:`Fp8GemmConfig` (``block_fp8_gemm(..., config=...)``) sets the
tile sizes, warps, pipeline stages and K splits; every field left ``None`` takes the
default heuristic (:func:`resolve_fp8_gemm_config`), so ``config=None`` launches exactly
what the heuristic chose before configs existed. Its other fields select variants of the
same kernel (constexpr flags, off by default):

- ``group_m`` > 1: programs walk the output tiles in groups of ``group_m`` M-tiles
  (the usual L2 swizzle) instead of M-tile-fastest order; same values, another order.
- ``weight_only``: no activation quantization; the kernel feeds ``x`` (bf16/fp16) and
  the fp8 weight tile upcast to ``x``'s dtype to the MMA and scales the partial product
  by the weight block's scale: ``x @ (w_fp8 * scale)^T`` with float32 accumulation. Its
  reference is the float32 matmul of ``x`` with the dequantized weights, not
  :func:`~pdserve.kernels.reference.block_fp8_matmul_reference`.
- ``atomic_splits``: with more than one K split, each program adds its float32 partial
  into one zeroed float32 output with atomics, instead of storing it for a separate
  ``sum``. The order of those additions varies from run to run, so results are not
  bitwise deterministic (they differ in the last bits of float32).

``BLOCK_K`` is always 128, one weight scale per K step.

``torch._scaled_mm`` with 1x128 / 128x128 block scales (PyTorch's blockwise FP8 recipe,
Hopper only) is an alternative for large M; :func:`scaled_mm_block_fp8` wraps it and
:mod:`pdserve.layers.fp8` checks it once against the reference before using it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import (
    check_device,
    dot_fp8,
    dot_precision,
    dot_upcast,
    fp8_mma,
    grouped_tile,
    interpret_mode,
    num_sms,
    pdl_args,
    pdl_enter,
    quantize_rows_e4m3,
    rows_2d,
)
from pdserve.kernels.reference import FP8_GROUP, FP8_MAX, Fp8Activation

GROUP_K = FP8_GROUP


@triton.jit(do_not_specialize=["M", "k_blocks_per_split"])  # one compile per tile config
def _block_fp8_gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_os,
    stride_om,
    k_blocks_per_split,
    SCALE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP8_DOT: tl.constexpr,
    QMAX: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    GROUP_M: tl.constexpr = 1,
    WEIGHT_ONLY: tl.constexpr = False,
    ATOMIC: tl.constexpr = False,
    UPCAST: tl.constexpr = False,
    DOT_PREC: tl.constexpr = "tf32",
    PRE_Q: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_m, pid_n = grouped_tile(GROUP_M)  # GROUP_M > 1: M-tiles sweep N-tiles together
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_scale_rows = (offs_n // SCALE_N).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb0 = split * k_blocks_per_split
    num_kb = tl.cdiv(K, BLOCK_K)
    for kb in range(kb0, tl.minimum(kb0 + k_blocks_per_split, num_kb)):
        ks = kb * BLOCK_K + offs_k
        k_ok = ks < K
        if WEIGHT_ONLY:  # x as it is, the fp8 weights upcast; only the weight scale
            a = tl.load(
                x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + ks[:, None],
                mask=n_ok[None, :] & k_ok[:, None],
                other=0.0,
            )  # [BLOCK_K, BLOCK_N] fp8
            if UPCAST:  # the interpreter multiplies bf16 bits: go through float32
                part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(a, b.to(a.dtype), input_precision=DOT_PREC)
            b_scale = tl.load(ws_ptr + w_scale_rows + kb, mask=n_ok, other=0.0)
            acc += part * b_scale[None, :]
        else:
            if PRE_Q:  # quantized by the producer: fp8 values and their group scales
                a_q = tl.load(
                    x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                a_scale = tl.load(
                    xs_ptr + offs_m.to(tl.int64) * stride_xsm + kb, mask=m_ok, other=0.0
                )
            else:
                a = tl.load(
                    x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                a_q, a_scale = quantize_rows_e4m3(a, QMAX, ROUND_FIRST)  # a_scale: [BLOCK_M]
            b = tl.load(
                w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + ks[:, None],
                mask=n_ok[None, :] & k_ok[:, None],
                other=0.0,
            )  # [BLOCK_K, BLOCK_N] fp8
            part = dot_fp8(a_q, b, FP8_DOT)
            b_scale = tl.load(ws_ptr + w_scale_rows + kb, mask=n_ok, other=0.0)  # [BLOCK_N]
            acc += part * a_scale[:, None] * b_scale[None, :]
    if ATOMIC:  # every split adds into the same float32 [M, N]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.atomic_add(out, acc, mask=m_ok[:, None] & n_ok[None, :], sem="relaxed")
    else:
        out = (
            out_ptr + split * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        )
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def choose_splits(m_tiles: int, n_tiles: int, k_blocks: int, sms: int) -> int:
    """K splits so that about two programs run per multiprocessor (1 for large batches)."""
    tiles = m_tiles * n_tiles
    if tiles >= sms:
        return 1
    return max(1, min(k_blocks, -(-2 * sms // tiles), 16))


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch configuration of :func:`block_fp8_gemm`; ``None`` fields take the default
    heuristic (:func:`resolve_fp8_gemm_config`). ``block_m`` and ``block_n`` are powers of
    two >= 16 (``tl.dot``'s smallest tile); ``num_splits`` is the number of K splits asked
    for (the launch may use fewer so that none is empty); ``group_m``, ``weight_only`` and
    ``atomic_splits`` select the kernel variants the module docstring describes."""

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    num_splits: int | None = None
    group_m: int | None = None
    weight_only: bool = False
    atomic_splits: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            v = getattr(self, name)
            if v is not None and (v < (16 if name != "num_warps" else 1) or v & (v - 1)):
                raise ValueError(f"Fp8GemmConfig.{name} must be a power of two, got {v}")
        for name in ("num_stages", "num_splits", "group_m"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"Fp8GemmConfig.{name} must be >= 1, got {v}")


def resolve_fp8_gemm_config(
    m: int, n: int, k: int, sms: int, config: Fp8GemmConfig | None = None
) -> Fp8GemmConfig:
    """``config`` with every ``None`` field filled in for an [m, k] x [n, k]^T GEMM on a
    GPU of ``sms`` multiprocessors: block_m 16/32/64 by ``m``; block_n 128, except 64
    for up to 64 rows when 128-wide tiles would fill the GPU without splitting K; 4
    warps (33-64 rows splitting K: 256-wide tiles on 8 warps, about one program an SM), 3
    stages, K splits from :func:`choose_splits`, no grouping. The returned
    ``num_splits`` is the one the launch uses (no split left empty).

    Split-K tiles are 128 wide from the H200 sweep of 2026-12-02 (RESULTS.md, run 38:
    llama-8b down_proj, graph replays): 1 and 16 rows 33.0 -> 25.7 and 32.4 -> 26.6 us,
    64 rows 54.5 -> 46.8 us against 64-wide tiles, splits by the same heuristic."""
    cfg = config or Fp8GemmConfig()
    block_m = cfg.block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    split_k = triton.cdiv(m, block_m) * triton.cdiv(n, 128) < sms
    # 64-row split-K tiles are 256 wide on 8 warps, one program an SM (the same sweep at
    # 64 rows: 46.8 us with 128-wide tiles on 4 warps and 9 splits, 37.7 us so with 8)
    wide = split_k and block_m == 64 and cfg.block_n is None and cfg.num_warps is None
    block_n = cfg.block_n or (256 if wide else 64 if m <= 64 and not split_k else 128)
    k_blocks = triton.cdiv(k, GROUP_K)
    splits = cfg.num_splits or choose_splits(
        triton.cdiv(m, block_m), triton.cdiv(n, block_n), k_blocks, sms // 2 if wide else sms
    )
    per_split = triton.cdiv(k_blocks, min(splits, k_blocks))
    return replace(
        cfg,
        block_m=block_m,
        block_n=block_n,
        num_warps=cfg.num_warps or (8 if wide else 4),
        num_stages=cfg.num_stages or 3,
        num_splits=triton.cdiv(k_blocks, per_split),
        group_m=cfg.group_m or 1,
    )


def block_fp8_gemm(
    x: torch.Tensor | Fp8Activation,
    w: torch.Tensor,
    w_scale_inv: torch.Tensor,
    scale_n: int = GROUP_K,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    num_splits: int | None = None,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """``x`` [..., K] (bf16/fp16/fp32) times ``w`` [N, K] fp8 transposed, with
    ``w_scale_inv`` [ceil(N/scale_n), ceil(K/128)]; returns [..., N] in ``out_dtype``
    (default ``x``'s dtype). ``num_splits`` overrides the split-K heuristic (and
    ``config.num_splits``); ``config`` sets the launch (:class:`Fp8GemmConfig`; ``None``:
    the heuristic). An :class:`~pdserve.kernels.reference.Fp8Activation` ``x`` (quantized
    by its producer) is read as it is: fp8 values and their group scales, no quantization
    here; the output dtype defaults to its ``dtype``."""
    pre_q = isinstance(x, Fp8Activation)
    xv = x.q if isinstance(x, Fp8Activation) else x
    check_device(xv, "block_fp8_gemm")
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    if w.shape[1] != k or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn [N, {k}], got {w.dtype} {tuple(w.shape)}")
    k_blocks = triton.cdiv(k, GROUP_K)
    if tuple(w_scale_inv.shape) != (triton.cdiv(n, scale_n), k_blocks):
        raise ValueError(
            f"weight_scale_inv has shape {tuple(w_scale_inv.shape)}, expected "
            f"{(triton.cdiv(n, scale_n), k_blocks)} for {n}x{k} weights in {scale_n}x128 blocks"
        )
    x2 = rows_2d(xv)
    m = x2.shape[0]
    xs = rows_2d(x.scale) if isinstance(x, Fp8Activation) else x2
    dtype = out_dtype or x.dtype
    if m == 0:
        return xv.new_empty(*lead, n, dtype=dtype)
    if num_splits:
        config = replace(config or Fp8GemmConfig(), num_splits=num_splits)
    if pre_q and config is not None and config.weight_only:
        raise ValueError("block_fp8_gemm: weight_only takes a bf16/fp16 x, not an Fp8Activation")
    cfg = resolve_fp8_gemm_config(m, n, k, num_sms(xv.device), config)
    assert cfg.block_m and cfg.block_n and cfg.num_splits  # resolved
    m_tiles, n_tiles = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    splits = cfg.num_splits
    per_split = triton.cdiv(k_blocks, splits)
    atomic = cfg.atomic_splits and splits > 1
    dev = xv.device
    if atomic:
        out = torch.zeros(1, m, n, dtype=torch.float32, device=dev)
    elif splits == 1:
        out = torch.empty(1, m, n, dtype=dtype, device=dev)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=dev)
    ws = w_scale_inv.float().contiguous()
    _block_fp8_gemm_kernel[(m_tiles, n_tiles, splits)](
        x2,
        xs,
        w,
        ws,
        out,
        m,
        n,
        k,
        x2.stride(0),
        xs.stride(0),
        w.stride(0),
        ws.stride(0),
        out.stride(0),
        out.stride(1),
        per_split,
        SCALE_N=scale_n,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=GROUP_K,
        FP8_DOT=fp8_mma(dev),
        QMAX=FP8_MAX,
        ROUND_FIRST=interpret_mode(),
        GROUP_M=cfg.group_m,
        WEIGHT_ONLY=cfg.weight_only,
        ATOMIC=atomic,
        UPCAST=cfg.weight_only and dot_upcast(x2.dtype),
        DOT_PREC=dot_precision(x2.dtype),
        PRE_Q=pre_q,
        num_warps=cfg.num_warps,
        num_stages=1 if interpret_mode() else cfg.num_stages,
        **pdl_args(x2.device),
    )
    if splits > 1 and not atomic:  # one launch: the float32 partials' sum (+ bias), cast
        return splitk_sum(out, bias, dtype).view(*lead, n)
    y = out[0]
    if bias is not None:
        y = y + bias
    return y.to(dtype).view(*lead, n)


@triton.jit
def _splitk_sum_kernel(
    part_ptr, bias_ptr, out_ptr, total, n, stride_s,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):  # in split order, as a sequential sum over dim 0
        acc += tl.load(part_ptr + s * stride_s + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def splitk_sum(parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``(parts.sum(0) + bias).to(dtype)`` for the split-K partials ``parts`` [S, M, N]
    float32 (contiguous) in one launch, where ``sum``, the bias add and the cast took
    two or three (each a kernel boundary of a decode step's graph). Float32 throughout,
    one rounding to ``dtype``; splits added in order."""
    splits, m, n = parts.shape
    out = torch.empty(m, n, dtype=dtype, device=parts.device)
    if m * n == 0:
        return out
    block = 1024
    _splitk_sum_kernel[(triton.cdiv(m * n, block),)](
        parts,
        bias if bias is not None else parts,
        out,
        m * n,
        n,
        parts.stride(0),
        SPLITS=splits,
        HAS_BIAS=bias is not None,
        BLOCK=block,
        num_warps=4,
        **pdl_args(parts.device),
    )
    return out


def scaled_mm_block_fp8(
    x: torch.Tensor | Fp8Activation,
    w: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``torch._scaled_mm`` with PyTorch's blockwise recipe: ``x`` [M, K] quantized per
    token per 128 channels (scales [M, K/128], M-major; an ``Fp8Activation`` as its
    producer quantized it), ``w`` [N, K] with 128x128 block scales [N/128, K/128]. CUDA
    (Hopper) only; K and N must be multiples of 128. Raises whatever PyTorch raises where
    the recipe is not supported."""
    from pdserve.kernels.reference import quantize_fp8_groups

    if isinstance(x, Fp8Activation):
        k = x.shape[-1]
        x_q, x_scale = x.q.reshape(-1, k), x.scale.reshape(-1, x.scale.shape[-1])
    else:
        x_q, x_scale = quantize_fp8_groups(x)
    scale_a = x_scale.t().contiguous().t()  # M-major ("outer-dim-major") layout
    return torch._scaled_mm(
        x_q, w.t(), scale_a=scale_a, scale_b=w_scale_inv.float().t(), out_dtype=out_dtype
    )
