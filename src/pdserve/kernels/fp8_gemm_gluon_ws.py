"""Block-scaled FP8 GEMM at prefill sizes with warp specialization (Gluon, issue 28): the
``"ws"`` prefill kernel of :func:`~pdserve.kernels.fp8_gemm_gluon.fp8_gemm_gluon`.

Why another schedule. The ``"tma"`` kernel (:mod:`pdserve.kernels.fp8_gemm_gluon`) has
one partition of two warpgroups: the same warps wait for a stage's tiles, issue its MMA,
promote the previous step's partial product (scaled, on the CUDA cores) and start the
copy that refills a stage, and every K step ends in a barrier across both warpgroups
before that copy. It reached 43% of the FP8 rate at 8,192 tokens on the H100
(RESULTS.md session 29). Here each role has its own warps:

- a loader partition starts the Tensor Memory Accelerator copies of every K step into a
  ring of ``STAGES`` stages, waiting only for a stage's ``empty`` barrier;
- two math warpgroups take 64 rows of the 128-row tile each, independently: wait for a
  stage's ``ready`` barrier, issue its MMA into a fresh accumulator, wait for the
  previous step's MMA, release that stage (``empty`` counts both warpgroups), promote
  its partial product, and store their rows at the tile's end;
- the grid is persistent (a program a multiprocessor, walking the tiles in the grouped
  order), so the loader copies the next tile's first steps while the math warpgroups
  finish and store the last.

Same product, same promotion (each 128-wide K step's partial scaled by its row and
weight scales before it joins the float32 accumulator), same operands as the ``"tma"``
kernel. Gluon has no interpreter: the CPU suite compiles this kernel for sm_90a
(tools/sm90_report.py) and the parity tests run on the GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma_wait,
)

from pdserve.kernels._utils import num_sms
from pdserve.kernels.fp8_gemm_gluon_tiles import (
    BLOCK_M,
    BLOCK_N,
    GROUP_M,
    scale_rows,
    step_mma,
    store_tile,
    tile_at,
    tile_descs,
)

STAGES = 4  # 4 x 32 KB
WARPS = 4  # the default partition: the loader; the two math warpgroups are its workers
MATH_REGS = 232  # a math thread: the accumulator, the partial being promoted, the next
MAXNREG = 168  # the launch's registers a thread: 168 x 384 threads fit the 64K


@gluon.jit
def _ws_load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
             STAGES: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """The loader: every tile's K steps, in the order the math warpgroups take them, into
    the ring; a stage is refilled once both warpgroups released it."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    NBYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    k_steps = gl.cdiv(K, BK)
    num_tiles = gl.cdiv(M, BM) * gl.cdiv(N, BN)
    g = 0  # steps issued by this program, over all its tiles
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = tile_at(tile, M, N, BM, BN, GROUP_M)
        for kb in range(k_steps):
            s = g % STAGES
            # a fresh barrier counts as having completed phase 1: the first round passes
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), NBYTES)
            tma.async_copy_global_to_shared(a_desc, [off_m, kb * BK], ready.index(s),
                                            a_bufs.index(s))  # fmt: skip
            tma.async_copy_global_to_shared(b_desc, [off_n, kb * BK], ready.index(s),
                                            b_bufs.index(s))  # fmt: skip
            g += 1


@gluon.jit
def _ws_math(W: gl.constexpr, a_bufs, b_bufs, ready, empty, xs_ptr, ws_ptr, out_ptr, M, N, K,
             stride_xsm, stride_wsn, stride_om, SCALE_N: gl.constexpr, STAGES: gl.constexpr,
             GROUP_M: gl.constexpr):  # fmt: skip
    """Math warpgroup ``W``: rows ``64 W`` to ``64 W + 63`` of every tile of this program.
    Step k's MMA is issued before step k - 1's partial is promoted (as in the ``"tma"``
    kernel), and step k - 1's stage is released as soon as its MMA is done."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    HALF: gl.constexpr = BM // 2
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32]
    )
    k_steps = gl.cdiv(K, BK)
    num_tiles = gl.cdiv(M, BM) * gl.cdiv(N, BN)
    g = 0  # steps taken by this program, over all its tiles (the loader's count)
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = tile_at(tile, M, N, BM, BN, GROUP_M)
        row0 = off_m + W * HALF
        xs_rows, m_ok, ws_rows = scale_rows(xs_ptr, ws_ptr, row0, off_n, M, stride_xsm,
                                            stride_wsn, SCALE_N, HALF, BN, ACC)  # fmt: skip
        acc = gl.zeros([HALF, BN], gl.float32, layout=ACC)
        prev = g % STAGES
        mbarrier.wait(ready.index(prev), (g // STAGES) & 1)
        part, a_s, b_s = step_mma(a_bufs.index(prev).slice(W * HALF, HALF, dim=0),
                                  b_bufs.index(prev), xs_rows, m_ok, ws_rows, 0, ACC)  # fmt: skip
        g += 1
        for kb in range(1, k_steps):
            s = g % STAGES
            mbarrier.wait(ready.index(s), (g // STAGES) & 1)
            nxt, a_next, b_next = step_mma(a_bufs.index(s).slice(W * HALF, HALF, dim=0),
                                           b_bufs.index(s), xs_rows, m_ok, ws_rows, kb, ACC)  # fmt: skip
            done = warpgroup_mma_wait(num_outstanding=1, deps=(part,))  # step kb - 1
            mbarrier.arrive(empty.index(prev), count=1)
            acc += done * (a_s * b_s)[:, None]
            part = nxt
            a_s = a_next
            b_s = b_next
            prev = s
            g += 1
        done = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        mbarrier.arrive(empty.index(prev), count=1)
        acc += done * (a_s * b_s)[:, None]
        store_tile(acc, out_ptr, row0, off_n, M, N, stride_om, HALF, BN, 4)


@gluon.jit(do_not_specialize=["M"])  # M % 16 would compile another variant
def _fp8_gemm_ws_kernel(
    a_desc, b_desc, xs_ptr, ws_ptr, out_ptr, M, N, K, stride_xsm, stride_wsn, stride_om,
    SCALE_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
    MATH_REGS: gl.constexpr,
):  # fmt: skip
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    BAR: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)  # the loader's expect, then the bytes
        mbarrier.init(empty.index(s), count=2)  # both math warpgroups
    # (the argument tuples written out in the call: constexprs in a tuple bound to a name
    # reach the partitions as tensors)
    gl.warp_specialize([
        (_ws_load, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, STAGES, GROUP_M)),
        (_ws_math, (0, a_bufs, b_bufs, ready, empty, xs_ptr, ws_ptr, out_ptr, M, N, K,
                    stride_xsm, stride_wsn, stride_om, SCALE_N, STAGES, GROUP_M)),
        (_ws_math, (1, a_bufs, b_bufs, ready, empty, xs_ptr, ws_ptr, out_ptr, M, N, K,
                    stride_xsm, stride_wsn, stride_om, SCALE_N, STAGES, GROUP_M)),
    ], [4, 4], [MATH_REGS, MATH_REGS])  # fmt: skip


def ws_constexprs(scale_n: int) -> dict[str, int]:
    """The kernel's compile-time arguments (shared with tools/sm90_report)."""
    return dict(SCALE_N=scale_n, STAGES=STAGES, GROUP_M=GROUP_M, MATH_REGS=MATH_REGS)


def fp8_gemm_ws(x2: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                out: torch.Tensor, scale_n: int) -> torch.Tensor:  # fmt: skip
    """``out`` [M, N] = ``x2`` [M, K] fp8 (row scales ``xs`` [M, K / 128]) times ``w``
    [N, K] fp8 (scales ``ws``) transposed. The caller
    (:func:`~pdserve.kernels.fp8_gemm_gluon.fp8_gemm_gluon`) checked the operands and
    that the Tensor Memory Accelerator can address them."""
    m, k = x2.shape
    n = w.shape[0]
    a_desc, b_desc = tile_descs(x2, w)
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    _fp8_gemm_ws_kernel[(min(tiles, num_sms(x2.device)),)](
        a_desc, b_desc, xs, ws, out, m, n, k, xs.stride(0), ws.stride(0), out.stride(0),
        **ws_constexprs(scale_n), num_warps=WARPS, maxnreg=MAXNREG,
    )  # fmt: skip
    return out
