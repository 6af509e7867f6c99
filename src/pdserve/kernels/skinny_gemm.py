"""``y = prologue(x) W^T (+ b)`` for decode batches: few rows, the weight read once.

At 1-64 rows a linear layer is a weight stream: the step's time is the weight's bytes
over the memory bandwidth. cuBLAS' choice for some decode shapes leaves bandwidth unused
(llama-8b-shape's 4096 x 4096 ``o_proj`` at one row: 64 column tiles on 132 SMs, about
half the copy rate on the H100, RESULTS.md run 104), and its split-K shapes add a reduce
launch. This kernel gives each program ``BLOCK_N`` output columns of every row (all
rows in one tile, so the weight is read once) over the whole K range: no split, no
reduce, one launch.

A prologue can fold the layer's producer into the load of ``x``, so the step launches
one kernel where it launched two (the activation is a few KB a row; every program
recomputes it from L2):

- ``"rmsnorm"``: ``x`` is ``rmsnorm(x + residual) * norm_weight`` with the numerics of
  :mod:`pdserve.kernels.rmsnorm` (the sum rounded to ``x.dtype``, float32 statistics,
  the normalised value rounded before the weight multiply and the product rounded
  again); the sum is written to ``residual_out`` by the first column tile's programs.
  Each program first passes over its rows once for the sum of squares. With
  ``SkinnyConfig.one_pass_norm`` there is no such pass: the rows' sum of squares
  accumulates beside the GEMM over ``(x + residual) * norm_weight`` (rounded to
  ``x.dtype``), and ``1 / rms``, a per-row factor, scales the output at the end (the
  same product, rounded once rather than twice before the GEMM).
- ``"silu_mul"``: ``x`` is the merged gate|up output [M, 2K] and the GEMM input is
  ``silu(gate) * up`` with :mod:`pdserve.kernels.activation`'s rounding.

FP8 weights (``weight_scale`` given): block-scaled float8_e4m3fn as DeepSeek-V3 ships
them, read as they are (half the bytes) and upcast in registers. A 128-wide K step's
partial product is scaled by its block's scale; a wider step (:func:`wide_fp8_steps`:
more weight bytes in flight a program) scales each activation column by its 128-group's
scale before the product instead. On the register path the weight is read as int32
words of four values (rows 4-byte aligned), widened by the hardware's pairwise e4m3
conversion where they were loaded: compiled for sm_90a a 512-wide step is 139 SASS
instructions at the default tiles, against 318 when each byte was shuffled into place
for the conversion (``tools/sm90_report.py``, ``skinny1_fp8``; bf16: 152 for twice the
bytes). The activation stays in its dtype (the
block-FP8 GEMM's weight-only mode, :mod:`pdserve.kernels.fp8_gemm`): at decode sizes the
weight bytes are the cost, and the prologues need no quantizing producer.

Split-K (``SkinnyConfig.split_k`` > 1): where the column tiles alone leave SMs idle
(a 4096-wide output in 32-column tiles is 128 programs on 132 SMs, one weight stream
each), each tile's K range is cut into that many slices, one program each. Every
program stores its float32 partial, then counts itself on the tile's counter; the last
one of the tile sums the partials in slice order (so the result does not depend on which
finished first), writes the output and sets the counter back to zero for the next
launch. Still one launch; the counters are a per-device buffer of zeros
(:func:`_tile_counters`), so split-K launches on one device must not run concurrently
on two streams (the engine's forward runs on one).

The rows go into one ``tl.dot`` tile (``BLOCK_M``, at least 16: the MMA's smallest; rows
past M are masked to zero), or, with ``BLOCK_M`` 1, a multiply-and-add in registers whose
per-element partials are summed over K once, after the loop. Launched dependently (PDL),
that one-row path loads its first weight steps before it waits for the previous kernel
(``SkinnyConfig.early_w``): the weights are no kernel's output.
Grid: (column tiles, row tiles, K slices); shapes only, no host sync, capturable in a
CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import (
    check_device,
    dot_precision,
    dot_upcast,
    e4m3_to_f16,
    fp8x4_to_f32,
    interpret_mode,
    next_pow2,
    num_sms,
    pdl_args,
    pdl_enter,
    rows_2d,
)
from pdserve.kernels.activation import silu_mul_values
from pdserve.kernels.reference import FP8_GROUP
from pdserve.kernels.rmsnorm import rms_output

PROLOGUES = ("none", "rmsnorm", "silu_mul")


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles and pipeline of :func:`skinny_gemm` (``block_m`` None: the rows' power of
    two, at least 16, or 1 for a single row when ``row_dot`` is off)."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    block_m: int | None = None
    row_dot: bool = True  # one row through the MMA too (else a register multiply-and-sum)
    prefetch: bool = False  # the next K step's activation loads issued before this step's use
    split_k: int = 1  # K slices per column tile, summed by the tile's last program
    # rmsnorm prologue: one pass (the sum of squares beside the GEMM, 1 / rms applied to
    # the output; needs split_k 1) instead of a pass for the statistics first
    one_pass_norm: bool = False
    # register path (one row): K steps of the weight loaded before the dependent launch's
    # wait (0-2), so they stream while the previous kernel finishes (PDL); each later
    # step's load is then issued that many steps ahead of its use
    early_w: int = 0
    # MMA tile (more than one row): the product transposed, y^T = W x^T, so the weight's
    # columns are the MMA's M (64 or more: Hopper's warpgroup MMA, operands from shared
    # memory) and the rows its N (from 8), instead of the rows as M (at least 16)
    swap: bool = False


@triton.jit
def _raw_tile(x_ptr, r_ptr, rows, rmask, k0, ks, stride_x, stride_r, K,
              PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    """The loads behind the GEMM input's [rows, k0 + ks] tile: x's, and the residual's
    (rmsnorm) or the up half's (silu_mul), else x's again. Past K: zeros, nothing read."""
    kk = k0 + ks
    m2 = rmask[:, None] & (kk < K)[None, :]
    offs = rows[:, None].to(tl.int64) * stride_x + kk[None, :]
    x = tl.load(x_ptr + offs, mask=m2, other=0.0)
    if PROLOGUE == 2:
        q = tl.load(x_ptr + offs + K, mask=m2, other=0.0)
    elif PROLOGUE == 1 and HAS_RES:
        roffs = rows[:, None].to(tl.int64) * stride_r + kk[None, :]
        q = tl.load(r_ptr + roffs, mask=m2, other=0.0)
    else:
        q = x
    return x, q


@triton.jit
def _norm_in(x, q, HAS_RES: tl.constexpr):
    """The rmsnorm prologue's input in float32: ``x``, or ``x + residual`` (``q``) rounded
    to x's dtype (the add+RMSNorm kernel's rounding)."""
    z = x.to(tl.float32)
    if HAS_RES:
        z = (z + q.to(tl.float32)).to(x.dtype).to(tl.float32)
    return z


@triton.jit
def _norm_sum(x, q, ro_ptr, rows, rmask, kk, stride_ro, K, write, HAS_RES: tl.constexpr):
    """:func:`_norm_in`, with the sum stored to ``ro`` where ``write`` (and a residual)."""
    z = _norm_in(x, q, HAS_RES)
    if HAS_RES:  # noqa: SIM102 (a compile-time branch around the run-time one)
        if write:
            ooffs = rows[:, None].to(tl.int64) * stride_ro + kk[None, :]
            tl.store(ro_ptr + ooffs, z.to(x.dtype), mask=rmask[:, None] & (kk < K)[None, :])
    return z


@triton.jit
def _squares(sq, z, BLOCK_M: tl.constexpr):
    """``sq`` plus the K step's squares of ``z``: per element on the register path (summed
    over K once after the pass: no reduction across the threads a step), else each row's
    sum (an MMA tile's rows would hold too many registers per element)."""
    if BLOCK_M == 1:
        return sq + z * z
    return sq + tl.sum(z * z, axis=1, keep_dims=True)


@triton.jit
def _input_tile(x, q, nw_ptr, kk, K, rstd, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):
    """The GEMM input's tile from :func:`_raw_tile`'s loads, in x's dtype."""
    if PROLOGUE == 1:
        z = _norm_in(x, q, HAS_RES)
        w = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        x = rms_output(z, rstd[:, None], w[None, :], x)
    elif PROLOGUE == 2:
        x = silu_mul_values(x, q).to(x.dtype)
    return x


@triton.jit
def _w_tile(w_base, k0, ks, nmask, k_hi, LOAD: tl.constexpr):
    """The weight's [BLOCK_N, k0 + ks] tile, zeros from ``k_hi`` on (nothing read there);
    without ``LOAD`` a placeholder of zeros."""
    kk = k0 + ks
    if LOAD:
        w = tl.load(w_base + kk[None, :], mask=nmask[:, None] & (kk < k_hi)[None, :], other=0.0)
    else:
        w = tl.zeros([w_base.shape[0], ks.shape[0]], w_base.dtype.element_ty)
    return w


@triton.jit
def _tile_product(acc, a, w, ws_base, ws_row, k0, K, nmask, FP8_W: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                  DOT_PREC: tl.constexpr, F8ASM: tl.constexpr, SWAP: tl.constexpr,
                  WORDS: tl.constexpr):  # fmt: skip
    """``acc`` plus the tile's ``a w^T`` over K columns ``k0`` to ``k0 + BLOCK_K``. FP8
    weights: a 128-wide step's partial product is scaled by its block's scale
    (``ws_base``: one a column); a wider step scales the activation's columns instead,
    each by its 128-group's scale (``ws_row``: the tile's one row of scales). On the
    register path (``BLOCK_M`` 1) ``acc`` is [BLOCK_N, BLOCK_K]: each element's products
    accumulate where they are, summed over K once after the loop (no reduction across the
    threads every K step). ``SWAP``: ``acc`` is the transposed tile [BLOCK_N, BLOCK_M],
    plus ``w a^T``. FP8 values are widened by the hardware's e4m3 -> f16 conversion
    (``F8ASM``). ``WORDS`` (FP8 on the register path): ``w`` holds four weights an int32,
    [BLOCK_N, BLOCK_K / 4], and so does ``acc``; each word's four products are added where
    the word is."""
    WIDE: tl.constexpr = FP8_W and BLOCK_K > 128
    DIV: tl.constexpr = 4 if WORDS else 1
    if WIDE:  # one scale per activation column (per word: its four share it)
        kk = k0 + DIV * tl.arange(0, BLOCK_K // DIV)
        sk = tl.load(ws_row + kk // 128, mask=kk < K, other=0.0)[None, :]
    elif FP8_W:  # one scale per weight column for the step
        sc = tl.load(ws_base + k0 // 128, mask=nmask, other=0.0)
    if FP8_W and not WORDS:  # exact in fp16, and from there in bf16 / fp32
        w = e4m3_to_f16(w, F8ASM)
    if BLOCK_M == 1:
        af = a.to(tl.float32)
        if WORDS:
            f0, f1, f2, f3 = fp8x4_to_f32(w, F8ASM)
            a0, a1, a2, a3 = _quarters(af, BLOCK_K)
            if WIDE:
                acc += f0 * (a0 * sk)
                acc += f1 * (a1 * sk)
                acc += f2 * (a2 * sk)
                acc += f3 * (a3 * sk)
            else:
                acc += (f0 * a0 + f1 * a1 + f2 * a2 + f3 * a3) * sc[:, None]
        else:
            if WIDE:
                af = af * sk
            part = w.to(tl.float32) * af
            if FP8_W and not WIDE:
                part *= sc[:, None]
            acc += part
    else:
        if FP8_W:
            w = w.to(a.dtype)
        if WIDE:
            a = (a.to(tl.float32) * sk).to(w.dtype)
        if UPCAST:  # the interpreter's bf16 dot (see dot_upcast)
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if SWAP:
            if FP8_W and not WIDE:
                acc += tl.dot(w, tl.trans(a), input_precision=DOT_PREC) * sc[:, None]
            else:
                acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PREC)
        elif FP8_W and not WIDE:
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PREC) * sc[None, :]
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _quarters(af, BLOCK_K: tl.constexpr):
    """[1, BLOCK_K] ``af`` as four [1, BLOCK_K / 4] tensors: the columns ``4 j + c`` for
    ``c`` = 0..3 (the bytes of :func:`fp8x4_to_f32`'s words)."""
    q = tl.reshape(af, [BLOCK_K // 4, 2, 2])
    even, odd = tl.split(q)  # columns 4 j + 2 p, and 4 j + 2 p + 1
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    return a0[None, :], a1[None, :], a2[None, :], a3[None, :]


@triton.jit
def _split_k_fixup(acc, part_ptr, cnt_ptr, rows, cols, omask, M, N,
                   SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Split-K: store this program's partial, count it on the tile's counter; the tile's
    last program gets the partials' sum in slice order (and resets the counter), the
    others get ``done`` False."""
    pid_k = tl.program_id(2)
    offs = (pid_k * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
    tl.store(part_ptr + offs, acc, mask=omask)
    tl.debug_barrier()  # every thread's partial stored before the release below
    tile = cnt_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    done = tl.atomic_add(tile, 1, sem="acq_rel") == SPLIT_K - 1
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if done:
        for s in tl.static_range(SPLIT_K):
            offs = (s * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
            total += tl.load(part_ptr + offs, mask=omask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(tile, 0)
    return total, done


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, ro_ptr, ws_ptr, part_ptr, cnt_ptr,
    M, N, K, K_SLICE, stride_x, stride_w, stride_y, stride_r, stride_ro, stride_ws, eps,
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP8_W: tl.constexpr, SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr = False, SPLIT_K: tl.constexpr = 1, ONE_PASS: tl.constexpr = False,
    UPCAST: tl.constexpr = False, DOT_PREC: tl.constexpr = "tf32", PDL: tl.constexpr = False,
    EARLY_W: tl.constexpr = 0, F8ASM: tl.constexpr = False, SWAP: tl.constexpr = False,
    WORDS: tl.constexpr = False,
):  # fmt: skip
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    nmask = cols < N
    ks = tl.arange(0, BLOCK_K)
    # WORDS (FP8 on the register path): the weight read as int32 words, four values each
    DIV: tl.constexpr = 4 if WORDS else 1
    wks = tl.arange(0, BLOCK_K // DIV)
    if WORDS:
        w_base = w_ptr.to(tl.pointer_type(tl.int32)) + cols[:, None].to(tl.int64) * (stride_w // 4)
    else:
        w_base = w_ptr + cols[:, None].to(tl.int64) * stride_w
    k_lo = tl.program_id(2) * K_SLICE  # split-K: this program's slice of K
    k_hi = tl.minimum(K, k_lo + K_SLICE)
    # EARLY_W: the weight is no predecessor's output, so its first K steps load before
    # the dependent launch's wait (the previous kernel may still be running)
    w0 = _w_tile(w_base, k_lo // DIV, wks, nmask, k_hi // DIV, EARLY_W > 0)
    w1 = _w_tile(w_base, (k_lo + BLOCK_K) // DIV, wks, nmask, k_hi // DIV, EARLY_W > 1)
    pdl_enter(PDL)
    # PREFETCH: each K step issues the next step's activation loads before it uses this
    # step's (a one-step ring in registers), so their latency overlaps the weight stream
    rstd = tl.zeros([BLOCK_M], tl.float32)
    # the rows' sums of squares (rmsnorm; _squares)
    if BLOCK_M == 1:
        sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    else:
        sq = tl.zeros([BLOCK_M, 1], tl.float32)
    first = (pid_n == 0) & (tl.program_id(2) == 0)  # the program that writes the sum
    if (PROLOGUE == 1) and (not ONE_PASS):  # a pass for the sum of squares first
        if PREFETCH:
            x, q = _raw_tile(x_ptr, r_ptr, rows, rmask, 0, ks, stride_x, stride_r, K, 1, HAS_RES)
        for k0 in range(0, K, BLOCK_K):
            if PREFETCH:
                xn, qn = _raw_tile(x_ptr, r_ptr, rows, rmask, k0 + BLOCK_K, ks, stride_x,
                                   stride_r, K, 1, HAS_RES)  # fmt: skip
            else:
                x, q = _raw_tile(x_ptr, r_ptr, rows, rmask, k0, ks, stride_x, stride_r, K, 1,
                                 HAS_RES)  # fmt: skip
            z = _norm_sum(x, q, ro_ptr, rows, rmask, k0 + ks, stride_ro, K, first, HAS_RES)
            sq = _squares(sq, z, BLOCK_M)
            if PREFETCH:
                x, q = xn, qn
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)
    # FP8 weights: one float32 scale per (SCALE_ROWS rows, 128 columns) block: a column's
    # scales (128-wide K steps), or the tile's one row of them (wider steps: the host
    # checks that BLOCK_N columns share it)
    ws_base = ws_ptr + (cols // SCALE_ROWS).to(tl.int64) * stride_ws
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // SCALE_ROWS).to(tl.int64) * stride_ws
    if BLOCK_M == 1:  # the register path's per-element partials (_tile_product)
        acc = tl.zeros([BLOCK_N, BLOCK_K // DIV], tl.float32)
    elif SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PREFETCH:
        x, q = _raw_tile(x_ptr, r_ptr, rows, rmask, k_lo, ks, stride_x, stride_r, K, PROLOGUE,
                         HAS_RES)  # fmt: skip
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if PREFETCH:
            xn, qn = _raw_tile(x_ptr, r_ptr, rows, rmask, k0 + BLOCK_K, ks, stride_x, stride_r,
                               K, PROLOGUE, HAS_RES)  # fmt: skip
        else:
            x, q = _raw_tile(x_ptr, r_ptr, rows, rmask, k0, ks, stride_x, stride_r, K, PROLOGUE,
                             HAS_RES)  # fmt: skip
        kk = k0 + ks
        if ONE_PASS:  # rmsnorm: the weighted sum now, the rows' 1 / rms at the end
            z = _norm_sum(x, q, ro_ptr, rows, rmask, kk, stride_ro, K, first, HAS_RES)
            sq = _squares(sq, z, BLOCK_M)
            nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            a = (z * nw[None, :]).to(x.dtype)
        else:
            a = _input_tile(x, q, nw_ptr, kk, K, rstd, PROLOGUE, HAS_RES)
        if EARLY_W == 0:
            w = _w_tile(w_base, k0 // DIV, wks, nmask, k_hi // DIV, True)
        elif EARLY_W == 1:
            w = w0
            w0 = _w_tile(w_base, (k0 + BLOCK_K) // DIV, wks, nmask, k_hi // DIV, True)
        else:
            w = w0
            w0 = w1
            w1 = _w_tile(w_base, (k0 + 2 * BLOCK_K) // DIV, wks, nmask, k_hi // DIV, True)
        acc = _tile_product(acc, a, w, ws_base, ws_row, k0, K, nmask, FP8_W, BLOCK_M, BLOCK_K,
                            UPCAST, DOT_PREC, F8ASM, SWAP, WORDS)  # fmt: skip
        if PREFETCH:
            x, q = xn, qn
    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)[None, :]
    elif SWAP:
        acc = tl.trans(acc)
    if ONE_PASS:
        acc = acc * tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
    omask = rmask[:, None] & nmask[None, :]
    done = True
    if SPLIT_K > 1:
        acc, done = _split_k_fixup(acc, part_ptr, cnt_ptr, rows, cols, omask, M, N, SPLIT_K,
                                   BLOCK_M, BLOCK_N)  # fmt: skip
    if done:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
        yoffs = rows[:, None].to(tl.int64) * stride_y + cols[None, :]
        tl.store(y_ptr + yoffs, acc.to(y_ptr.dtype.element_ty), mask=omask)


# two weight steps early: a llama-8b-shape layer's GEMM path at one row with PDL took
# 156.0 / 152.3 / 155.0 us against 161.0 / 156.9 / 159.9 with one and 159.2 / 155.1 /
# 158.3 with none (three calls, H100, RESULTS.md runs 125-127)
ONE_ROW = SkinnyConfig(block_n=8, block_k=512, row_dot=False, early_w=2)
# FP8 weights at one row: no weight step early (qkv 12.9 us against 20.3 with two early,
# gate|up 48.3 against 72.9: H100, RESULTS.md run 129)
ONE_ROW_FP8 = replace(ONE_ROW, early_w=0)
SWAP_16 = SkinnyConfig(block_n=64, block_k=256, num_stages=4, swap=True)


def default_config(rows: int, fp8: bool = False, n: int = 0, sms: int = 132) -> SkinnyConfig:
    """The tiles for ``rows`` rows where the caller gives none. One row takes the register
    path (8 columns x 512 K a program): a 16-row MMA tile would compute its prologue for
    15 masked rows too, which compiled for Hopper is 2,006 instructions a K step under
    SiLU-and-mul against 216 on this path (``tools/sm90_report.py``; 152 without a
    prologue), while the plain weight stream is as
    fast (qkv at one row: 20.7 against 20.8 us, RESULTS.md run 117). Its first two weight
    steps load before a dependent launch's wait (``early_w``).

    16-bit weights at 2-16 rows: the transposed tile (``swap``), 64 columns x 256 K a
    program, four stages: within 1 us of the sweep's best for each llama-8b-shape
    projection at 16 rows and 171 us a layer against 180 for the 32 x 256 MMA tile
    (RESULTS.md run 131, H100); at 64 rows it lost o and down, so more rows keep that tile.

    FP8 weights (``fp8``) at more rows: 64 of the ``n`` columns a program over 128-wide K
    steps, with split-K up to 4 slices until the programs are about two a multiprocessor
    (``sms``): the best of run 129's sweep at 16 and 64 rows (wider K steps lost there)."""
    if rows == 1:
        return ONE_ROW_FP8 if fp8 else ONE_ROW
    if fp8:
        tiles, split = -(-n // 64), 1
        while split < 4 and tiles * split < 2 * sms:
            split *= 2
        return SkinnyConfig(block_n=64, block_k=FP8_GROUP, split_k=split)
    return SWAP_16 if rows <= 16 else SkinnyConfig()


def prologue_pays(rows: int, prologue: str) -> bool:
    """Whether ``prologue``'s producer is worth folding into the launch at ``rows`` rows
    under :func:`default_config`: SiLU-and-mul on the register path (one row) only.

    - An MMA tile recomputes the prologue for all its rows, masked ones too, in every
      column-tile program: SiLU-and-mul + down at 16 rows took 271 us in one launch
      against 50 us in two (RESULTS.md run 119, H100).
    - add+RMSNorm costs each program a pass over its rows for the statistics before the
      weight stream starts: even on the register path qkv took 25.3 us with it against
      2.3 + 20.6 us for the norm's kernel then the plain launch, gate|up 88.2 against
      2.3 + 80.6 (run 119)."""
    return prologue == "silu_mul" and block_rows(default_config(rows), rows) == 1


def block_rows(cfg: SkinnyConfig, rows: int) -> int:
    """The row tile for ``rows`` rows: ``cfg.block_m``, else the rows' power of two, at
    least 16 (the MMA's smallest), or 1 for one row on the register path."""
    return cfg.block_m or (1 if rows == 1 and not cfg.row_dot else max(16, next_pow2(rows)))


def wide_fp8_steps(cfg: SkinnyConfig, scale_rows: int) -> bool:
    """Whether FP8 weights keep ``cfg``'s K steps: a multiple of 128 wider than 128 and
    a column tile within one row of scales (``scale_rows`` a multiple of ``block_n``), so
    each activation column takes its 128-group's scale. Otherwise the steps are 128 wide,
    one scale a (column, step)."""
    k = cfg.block_k
    return k > FP8_GROUP and k % FP8_GROUP == 0 and scale_rows % cfg.block_n == 0


def _word_aligned(weight: torch.Tensor) -> bool:
    """Whether an fp8 weight's rows can be read as int32 words (the register path's FP8
    loads): 4-byte aligned start and row stride, whole words of K."""
    return weight.data_ptr() % 4 == 0 and weight.stride(0) % 4 == 0 and weight.shape[1] % 4 == 0


RING_BYTES = 160 * 1024  # shared memory for the pipeline's ring of tiles (227 KB on Hopper)


def fit_stages(cfg: SkinnyConfig, block_m: int, x_bytes: int, w_bytes: int,
               prologue: str = "none", has_res: bool = False) -> int:  # fmt: skip
    """``cfg.num_stages``, cut so the ring of tiles in flight fits :data:`RING_BYTES`: the
    compiler keeps ``num_stages - 1`` K steps of every tile the loop loads (the weight's
    ``block_n x block_k`` and one activation tile of ``block_m x block_k``, two under the
    silu_mul prologue or a residual). 64 rows under add+RMSNorm at 4 stages would ask for
    280 KB."""
    inputs = 2 if prologue == "silu_mul" or has_res else 1
    per_step = cfg.block_k * (cfg.block_n * w_bytes + inputs * block_m * x_bytes)
    return max(1, min(cfg.num_stages, 1 + RING_BYTES // per_step))


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K tile counters of ``device``: int32 zeros that every launch leaves at
    zero. Made and grown outside a CUDA graph capture only (a capture runs no zero fill,
    and a graph keeps the buffer it baked in); the engine's eager warm-up runs each shape
    first."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"skinny_gemm split-K needs {tiles} tile counters, "
                f"{0 if buf is None else buf.numel()} exist; "
                "run the shape once outside the CUDA graph capture first"
            )
        buf = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: str = "none",
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    config: SkinnyConfig | None = None,
    weight_scale: torch.Tensor | None = None,
    scale_rows: int = 128,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``y = prologue(x) @ weight.T (+ bias)``, ``weight`` [N, K] (see the module doc).

    ``weight_scale``: ``weight`` is float8_e4m3fn with one float32 scale per
    ``scale_rows`` x 128 block ([ceil(N / scale_rows), ceil(K / 128)], DeepSeek-V3's
    ``weight_scale_inv``): ``x @ (weight * scale)^T``, the activation unquantized (the
    block-FP8 GEMM's weight-only mode). The tiles' K width is then 128 unless
    :func:`wide_fp8_steps`.

    ``prologue="rmsnorm"`` needs ``norm_weight`` [K]; with a ``residual`` it returns
    ``(y, x + residual)`` (a new tensor: other programs still read ``residual``).
    ``prologue="silu_mul"``: ``x`` is [..., 2K]."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES} (got {prologue!r})")
    check_device(x, "skinny_gemm")
    fp8 = weight_scale is not None
    cfg = config or default_config(x.numel() // max(1, x.shape[-1]), fp8, weight.shape[0],
                                   num_sms(x.device))  # fmt: skip
    if fp8 and not wide_fp8_steps(cfg, scale_rows):
        cfg = replace(cfg, block_k=FP8_GROUP)
    N, K = weight.shape
    x2 = rows_2d(x)
    width = 2 * K if prologue == "silu_mul" else K
    if x2.shape[1] != width:
        raise ValueError(f"x has {x2.shape[1]} columns; weight [{N}, {K}] needs {width}")
    if weight.stride(1) != 1:
        raise ValueError("weight must be contiguous along K")
    if fp8:
        want = (-(-N // scale_rows), -(-K // FP8_GROUP))
        if tuple(weight_scale.shape) != want or weight_scale.stride(1) != 1:  # type: ignore[union-attr]
            raise ValueError(f"weight_scale must be a contiguous {list(want)} (one per block)")
    M = x2.shape[0]
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    r2 = x2
    ro = x2
    has_res = residual is not None
    if prologue == "rmsnorm":
        if norm_weight is None or norm_weight.shape != (K,):
            raise ValueError(f"prologue 'rmsnorm' needs norm_weight of shape ({K},)")
        if residual is not None:
            r2 = rows_2d(residual)
            ro = torch.empty_like(x2)
    elif has_res or norm_weight is not None:
        raise ValueError("residual and norm_weight belong to the 'rmsnorm' prologue")
    if M > 0:
        block_m = block_rows(cfg, M)
        # split-K slices: whole K steps each, none empty
        steps = triton.cdiv(K, cfg.block_k)
        k_slice = triton.cdiv(steps, max(1, min(cfg.split_k, steps))) * cfg.block_k
        split = triton.cdiv(K, k_slice)
        one_pass = cfg.one_pass_norm and prologue == "rmsnorm"
        if cfg.early_w not in (0, 1, 2):
            raise ValueError(f"early_w must be 0, 1 or 2 K steps (got {cfg.early_w})")
        if one_pass and split > 1:
            raise ValueError("one_pass_norm needs each program to see all of K (split_k 1)")
        grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, block_m), split)
        part = cnt = y
        if split > 1:
            part = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
            cnt = _tile_counters(x.device, grid[0] * grid[1])
        _skinny_gemm_kernel[grid](
            x2, weight, bias if bias is not None else weight, y.view(-1, N), r2,
            norm_weight if norm_weight is not None else weight, ro,
            weight_scale if weight_scale is not None else weight, part, cnt,
            M, N, K, k_slice, x2.stride(0), weight.stride(0), N, r2.stride(0), ro.stride(0),
            weight_scale.stride(0) if weight_scale is not None else 0, eps,
            PROLOGUE=PROLOGUES.index(prologue), HAS_RES=has_res, HAS_BIAS=bias is not None,
            FP8_W=fp8, SCALE_ROWS=scale_rows, F8ASM=fp8 and not interpret_mode(),
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PREFETCH=cfg.prefetch,
            SPLIT_K=split, ONE_PASS=one_pass, EARLY_W=cfg.early_w if block_m == 1 else 0,
            SWAP=cfg.swap and block_m > 1, WORDS=fp8 and block_m == 1 and _word_aligned(weight),
            UPCAST=dot_upcast(x.dtype), DOT_PREC=dot_precision(x.dtype),
            num_stages=fit_stages(cfg, block_m, x.element_size(), weight.element_size(),
                                  prologue, has_res),
            num_warps=cfg.num_warps, **pdl_args(x.device),
        )  # fmt: skip
    if prologue == "rmsnorm" and has_res:
        return y, ro.view(x.shape)
    return y
