"""The tile helpers of the Gluon block-FP8 GEMMs at prefill sizes, shared by the
``"tma"`` / ``"cp_async"`` kernels (:mod:`pdserve.kernels.fp8_gemm_gluon`) and the
warp-specialized ``"ws"`` kernel (:mod:`pdserve.kernels.fp8_gemm_gluon_ws`): 128 x 128
output tiles over 128-wide K steps (one scale a step), their grouped order, the scales a
tile's K step needs, its MMA into a fresh accumulator, and the store."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pdserve.kernels.reference import FP8_GROUP

BLOCK_M = 128
BLOCK_N = 128
BLOCK_K = FP8_GROUP  # one scale a step
GROUP_M = 8


@gluon.jit
def tile_at(pid, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Tile ``pid``'s row and column offsets (``pid``: the program's index, or a
    persistent program's current tile) in the grouped order: GROUP_M row tiles sweep
    the column tiles together, so the programs running at once share their rows and
    columns in L2 (the order of :func:`pdserve.kernels._utils.grouped_tile`, which Gluon
    cannot call)."""
    num_m = gl.cdiv(M, BLOCK_M)
    width = GROUP_M * gl.cdiv(N, BLOCK_N)
    first_m = (pid // width) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    return (first_m + (pid % width) % size_m) * BLOCK_M, ((pid % width) // size_m) * BLOCK_N


@gluon.jit
def scale_rows(xs_ptr, ws_ptr, off_m, off_n, M, stride_xsm, stride_wsn, SCALE_N: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ACC: gl.constexpr):  # fmt: skip
    """The tile's activation-scale row pointers (one a row of the tile), which of them are
    real rows, and its weight-scale row: one weight scale a (tile, step), the scale blocks
    spanning the tile (a per-column scale would hold 2 x 32 more registers a thread than
    the three accumulators leave)."""
    rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ACC))
    xs_rows = xs_ptr + rm.to(gl.int64) * stride_xsm
    m_ok = rm < M
    gl.static_assert(SCALE_N % BLOCK_N == 0)
    return xs_rows, m_ok, ws_ptr + (off_n // SCALE_N).to(gl.int64) * stride_wsn


@gluon.jit
def step_mma(a_buf, b_buf, xs_rows, m_ok, ws_rows, kb, ACC: gl.constexpr):
    """Issue K step ``kb``'s MMA into a fresh accumulator (its zeros made where they are
    used, so no loop-long register tile holds them) and load the step's scales, which
    the caller applies once the MMA is done."""
    BLOCK_M: gl.constexpr = a_buf.type.shape[0]
    BLOCK_N: gl.constexpr = b_buf.type.shape[0]
    part = warpgroup_mma(a_buf, b_buf.permute((1, 0)),
                         gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=ACC), use_acc=False,
                         is_async=True)  # fmt: skip
    return part, gl.load(xs_rows + kb, mask=m_ok, other=0.0), gl.load(ws_rows + kb)


@gluon.jit
def store_tile(acc, out_ptr, off_m, off_n, M, N, stride_om, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, WARPS: gl.constexpr = 8):  # fmt: skip
    """Store an accumulator tile (``WARPS`` warps) in the output's dtype, rows past M and
    columns past N left out."""
    OUT: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[WARPS, 1], order=[1, 0]
    )
    y = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), OUT)
    om = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OUT))
    on = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OUT))
    gl.store(out_ptr + om[:, None].to(gl.int64) * stride_om + on[None, :], y,
             mask=(om < M)[:, None] & (on < N)[None, :])  # fmt: skip


def tile_layout() -> gl.NVMMASharedLayout:
    """The shared-memory layout of a 128 x 128 fp8 tile (both operands, K innermost)."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)


def tile_descs(x2: torch.Tensor, w: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """The Tensor Memory Accelerator's descriptors of ``x2`` [M, K] and ``w`` [N, K] fp8 in
    128 x 128 tiles (the caller checked that it can address them)."""
    lay = tile_layout()
    return (TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [BLOCK_M, BLOCK_K], lay),
            TensorDescriptor(w, list(w.shape), list(w.stride()), [BLOCK_N, BLOCK_K], lay))  # fmt: skip
