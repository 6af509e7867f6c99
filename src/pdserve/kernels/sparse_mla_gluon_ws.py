"""Sparse MLA prefill for Hopper with warp specialization (Gluon, issue 26): the ``gluon_ws``
variant of :func:`~pdserve.kernels.sparse_mla_gluon.sparse_mla_prefill_gluon`.

Why another schedule. In the plain Gluon kernel (:mod:`pdserve.kernels.sparse_mla_gluon`)
both warpgroups work on every 64-key tile: each scores 32 of its keys (an m64n32 MMA
whose query operand is re-read from shared memory for half the keys: shared-memory bound,
not tensor-core bound), the softmax's row max and sum cross the two warpgroups through
shared memory, and the next tile's gather is issued only once a step is under way, so
gather, MMA and softmax run one after another (the H200 measured it at 38% of the bf16
matmul rate and 29% of the rate at which the same rows can be gathered, RESULTS.md
run 49). Here each role has its own warps:

- a loader warpgroup gathers the candidate rows with asynchronous copies into two tile
  buffers (``k[0]``, ``k[1]``, 64 rows of ``LAT + ROPE`` each) and signals each buffer's
  halves as they land (``cp.async.mbarrier.arrive``: no thread waits on its copies);
- math warpgroup ``w`` (0 or 1) takes the tiles ``2 i + w``: it scores its whole tile
  (m64n64, all 64 heads), so a row's max and sum stay within one warpgroup; the two
  exchange only the tile's row maxima (both then use the same running max);
- the output's latent columns are split: warpgroup ``w`` owns ``O[:, w-th half]`` and
  adds ``P_w V_w`` (its own probabilities) and ``P_{1-w} V_{1-w}`` (the other's, read from
  shared memory) for its half. The probabilities are written over the tile's rope rows,
  which the score MMA was their last reader of (``ROPE`` = 64 = the tile's keys).

A buffer is released in two parts so the loader can refill it early: the half of its
latent columns that only its own warpgroup reads (its score and local value MMA), and the
rest (the other half, which the other warpgroup reads for its value MMA, and the rope
rows that carry ``P``). Each math warpgroup's score MMA starts on the first part as soon
as it has landed. The H200 ran a 16K-token prefill layer in 10.7 ms (410 TFLOP/s, 54% of
the bf16 matmul rate; the plain Gluon kernel 14.8 ms) and a 4K one in 2.7 ms (RESULTS.md
run 50). Registers: the loader needs few (24 a thread), so each math warpgroup gets 240;
ptxas still spills ~270 bytes of loop-invariant values in one of them
(tools/sm90_report.py).

Needs what :func:`supported` says (Hopper, a 16-bit cache, ``ROPE`` = 64, a latent width
of 128, 256 or 512); :func:`~pdserve.kernels.sparse_mla_gluon.sparse_mla_prefill_gluon`
runs the plain Gluon kernel for other operands. Gluon has no interpreter: the CPU suite
compiles this kernel for sm_90a (tools/sm90_report.py) and the parity tests run on the GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from pdserve.kernels._utils import LOG2E, capability

BLOCK_H = 64  # heads a program: the M of a warpgroup MMA
BLOCK_N = 64  # candidate rows a tile (= ROPE: the probabilities go over the rope rows)
CHUNK = gl.constexpr(64)  # columns a copy instruction covers (one 128-byte swizzle row)
WARPS = 4  # the default partition: the loader; the two math warpgroups are its workers
MATH_REGS = 240  # registers a math thread; the loader gets the rest: 3 x 168 - 2 x 240 = 24
MAXNREG = 168  # the launch's registers a thread: 168 x 384 threads fit the 64K


@gluon.jit
def _ws_math(
    W: gl.constexpr, smem, bars, qlat_ptr, qpe_ptr, cache_ptr,
    row_base, out_ptr, t, h0, n_cand, n_pairs, num_heads, qk_scale, stride_qlt, stride_qlh,
    stride_qpt, stride_qph, stride_cs, stride_ot, stride_oh,
    LAT: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Math warpgroup ``W``: tiles ``2 i + W`` scored in full, ``O[:, W-th half]``."""
    q_lat, q_rope, k_lat, k_rope, mx, lx = smem
    q_bar, ready, free, mbar, pbar, lbar = bars
    HALF: gl.constexpr = LAT // 2
    dt: gl.constexpr = qlat_ptr.dtype.element_ty
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    M_L: gl.constexpr = gl.SliceLayout(1, S_L)
    own_k = k_lat.index(W)
    own_r = k_rope.index(W)  # the rope rows of this warpgroup's buffer, then its P
    peer_k = k_lat.index(1 - W)
    peer_p = k_rope.index(1 - W)
    q_own = q_lat.slice(W * HALF, HALF, dim=1)
    q_peer = q_lat.slice((1 - W) * HALF, HALF, dim=1)
    v_own = own_k.slice(W * HALF, HALF, dim=1)  # [keys, this warpgroup's output columns]
    v_peer = peer_k.slice(W * HALF, HALF, dim=1)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=M_L)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=M_L)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=O_L)
    s0 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
    key_j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    mbarrier.wait(q_bar.index(0), 0)
    for i in range(n_pairs):
        ph = i & 1
        # the score: the buffer's own half first (it lands first), then the rest
        mbarrier.wait(ready.index(2 * W), ph)
        fence_async_shared()  # rows copied by cp.async, read by the MMA (async proxy)
        s = warpgroup_mma(q_own, own_k.slice(W * HALF, HALF, dim=1).permute((1, 0)), s0,
                          use_acc=False, is_async=True)  # fmt: skip
        mbarrier.wait(ready.index(2 * W + 1), ph)
        fence_async_shared()
        s = warpgroup_mma(q_peer, own_k.slice((1 - W) * HALF, HALF, dim=1).permute((1, 0)), s,
                          is_async=True)  # fmt: skip
        s = warpgroup_mma(q_rope, own_r.permute((1, 0)), s, is_async=True)
        j = (2 * i + W) * BLOCK_N + key_j
        key_ok = gl.load(row_base + j, mask=j < n_cand, other=-1) >= 0
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where(key_ok[None, :], s * qk_scale, float("-inf"))
        # both warpgroups take the same running max: publish this tile's, read the peer's
        m_t = gl.max(s, axis=1)
        mx.index(2 * ph + W).store(m_t)
        gl.thread_barrier()
        mbarrier.arrive(mbar.index(W), count=1)
        mbarrier.wait(mbar.index(1 - W), ph)
        m_new = gl.maximum(m_i, gl.maximum(m_t, mx.index(2 * ph + 1 - W).load(M_L)))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        own_r.store(p.to(dt))  # P over the rope rows (the score MMA was their last reader)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(pbar.index(W), count=1)
        acc = warpgroup_mma(own_r, v_own, acc, is_async=True)
        mbarrier.wait(pbar.index(1 - W), ph)
        acc = warpgroup_mma(peer_p, v_peer, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        gl.thread_barrier()  # this warpgroup is done with its own buffer
        mbarrier.arrive(free.index(2 * W), count=1)
        mbarrier.arrive(free.index(2 * W + 1), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # ... and with the peer's P and value half
        mbarrier.arrive(free.index(2 * (1 - W) + 1), count=1)

    # the row sums: each warpgroup summed its own tiles' probabilities
    lx.index(W).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(lbar.index(W), count=1)
    mbarrier.wait(lbar.index(1 - W), 0)
    l_t = gl.convert_layout(l_i + lx.index(1 - W).load(M_L), gl.SliceLayout(1, O_L))
    o = acc / gl.where(l_t > 0.0, l_t, 1.0)[:, None]
    oh = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    oc = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_L))
    dst = out_ptr + t * stride_ot + oh[:, None] * stride_oh + oc[None, :]
    gl.store(dst, o.to(dt), mask=(oh < num_heads)[:, None] & (oc[None, :] < LAT))


@gluon.jit
def _ws_copy_cols(dst, base, c0: gl.constexpr, n: gl.constexpr, mask, LD: gl.constexpr):
    """Copy columns ``c0 .. c0 + n`` of the rows at ``base`` (a pointer a row) into ``dst``
    (the same columns of a [rows, width] buffer), ``CHUNK`` columns an instruction."""
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LD))
    for c in gl.static_range(n // CHUNK):
        async_copy.async_copy_global_to_shared(
            dst.slice(c0 + c * CHUNK, CHUNK, dim=1), base[:, None] + (c0 + c * CHUNK) + cols[None, :],
            mask=mask[:, None],
        )  # fmt: skip


@gluon.jit
def _ws_loader(
    smem, bars, qlat_ptr, qpe_ptr, cache_ptr, row_base, out_ptr, t, h0, n_cand, n_pairs, num_heads, qk_scale, stride_qlt, stride_qlh, stride_qpt,
    stride_qph, stride_cs, stride_ot, stride_oh,
    LAT: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """The loader: the query, then tiles ``2 r`` and ``2 r + 1`` into buffers 0 and 1, each
    buffer's own half (the columns its warpgroup's output owns) before the rest; every
    thread's copies arrive on the buffer part's barrier when they land."""
    q_lat, q_rope, k_lat, k_rope, mx, lx = smem
    q_bar, ready, free, mbar, pbar, lbar = bars
    HALF: gl.constexpr = LAT // 2
    # a warp covers 4 rows x 64 columns in 16-byte pieces; 4 warps 16 rows a pass
    LD: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1], order=[1, 0]
    )
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    h_ok = heads < num_heads
    _ws_copy_cols(q_lat, qlat_ptr + t * stride_qlt + heads * stride_qlh, 0, LAT, h_ok, LD)
    _ws_copy_cols(q_rope, qpe_ptr + t * stride_qpt + heads * stride_qph, 0, ROPE, h_ok, LD)
    async_copy.mbarrier_arrive(q_bar.index(0), increment_count=False)
    key_j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    for r in range(n_pairs):
        fph = (r & 1) ^ 1  # a fresh barrier counts as having completed phase 1
        for b in gl.static_range(2):
            j = (2 * r + b) * BLOCK_N + key_j
            row = gl.load(row_base + j, mask=j < n_cand, other=-1)
            ok = row >= 0
            base = cache_ptr + gl.where(ok, row, 0).to(gl.int64) * stride_cs
            buf = k_lat.index(b)
            mbarrier.wait(free.index(2 * b), fph)
            _ws_copy_cols(buf, base, b * HALF, HALF, ok, LD)
            async_copy.mbarrier_arrive(ready.index(2 * b), increment_count=False)
            mbarrier.wait(free.index(2 * b + 1), fph)
            _ws_copy_cols(buf, base, (1 - b) * HALF, HALF, ok, LD)
            _ws_copy_cols(k_rope.index(b), base + LAT, 0, ROPE, ok, LD)
            async_copy.mbarrier_arrive(ready.index(2 * b + 1), increment_count=False)


@gluon.jit
def tile_buffers(dt: gl.constexpr, LAT: gl.constexpr, ROPE: gl.constexpr,
                 BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """The shared-memory tiles both Gluon sparse MLA kernels hold: the query's latent and
    rope parts (``BLOCK_H`` heads) and two buffers of ``BLOCK_N`` gathered cache rows,
    split the same way, in the layouts warpgroup MMAs read."""
    q_lat = gl.allocate_shared_memory(dt, [BLOCK_H, LAT],
                                      gl.NVMMASharedLayout.get_default_for([BLOCK_H, LAT], dt))
    q_rope = gl.allocate_shared_memory(dt, [BLOCK_H, ROPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dt))
    k_lat = gl.allocate_shared_memory(dt, [2, BLOCK_N, LAT],
                                      gl.NVMMASharedLayout.get_default_for([BLOCK_N, LAT], dt))
    k_rope = gl.allocate_shared_memory(dt, [2, BLOCK_N, ROPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dt))  # fmt: skip
    return q_lat, q_rope, k_lat, k_rope


@gluon.jit
def _gluon_ws_kernel(
    qlat_ptr, qpe_ptr, cache_ptr, rows_ptr, ncand_ptr, out_ptr, qk_scale, num_heads,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_cs, stride_rt, stride_ot, stride_oh,
    LAT: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    LOADER_THREADS: gl.constexpr, MATH_REGS: gl.constexpr,
):  # fmt: skip
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    n_cand = gl.load(ncand_ptr + t)
    n_pairs = gl.cdiv(n_cand, 2 * BLOCK_N)  # a missing last tile is all masked rows
    dt: gl.constexpr = qlat_ptr.dtype.element_ty
    q_lat, q_rope, k_lat, k_rope = tile_buffers(dt, LAT, ROPE, BLOCK_H, BLOCK_N)
    VEC: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    mx = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H], VEC)  # [phase, warpgroup]
    lx = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC)
    BAR: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], BAR)
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], BAR)  # [buffer, part]
    free = gl.allocate_shared_memory(gl.int64, [4, 1], BAR)
    mbar = gl.allocate_shared_memory(gl.int64, [2, 1], BAR)
    pbar = gl.allocate_shared_memory(gl.int64, [2, 1], BAR)
    lbar = gl.allocate_shared_memory(gl.int64, [2, 1], BAR)
    mbarrier.init(q_bar.index(0), count=LOADER_THREADS)
    for i in gl.static_range(4):
        mbarrier.init(ready.index(i), count=LOADER_THREADS)  # every loader thread's copies
        mbarrier.init(free.index(i), count=1 + i % 2)  # part 1: both warpgroups read it
    for i in gl.static_range(2):
        mbarrier.init(mbar.index(i), count=1)
        mbarrier.init(pbar.index(i), count=1)
        mbarrier.init(lbar.index(i), count=1)
    row_base = rows_ptr + t * stride_rt
    # (the argument tuples written out in the call: constexprs in a tuple bound to a name
    # reach the partitions as tensors)
    gl.warp_specialize([
        (_ws_loader, ((q_lat, q_rope, k_lat, k_rope, mx, lx), (q_bar, ready, free, mbar, pbar, lbar),
                      qlat_ptr, qpe_ptr, cache_ptr, row_base, out_ptr, t, h0, n_cand, n_pairs,
                      num_heads, qk_scale, stride_qlt, stride_qlh, stride_qpt, stride_qph,
                      stride_cs, stride_ot, stride_oh, LAT, ROPE, BLOCK_H, BLOCK_N)),
        (_ws_math, (0, (q_lat, q_rope, k_lat, k_rope, mx, lx), (q_bar, ready, free, mbar, pbar, lbar),
                     qlat_ptr, qpe_ptr, cache_ptr, row_base, out_ptr, t, h0, n_cand, n_pairs,
                     num_heads, qk_scale, stride_qlt, stride_qlh, stride_qpt, stride_qph,
                     stride_cs, stride_ot, stride_oh, LAT, ROPE, BLOCK_H, BLOCK_N)),
        (_ws_math, (1, (q_lat, q_rope, k_lat, k_rope, mx, lx), (q_bar, ready, free, mbar, pbar, lbar),
                     qlat_ptr, qpe_ptr, cache_ptr, row_base, out_ptr, t, h0, n_cand, n_pairs,
                     num_heads, qk_scale, stride_qlt, stride_qlh, stride_qpt, stride_qph,
                     stride_cs, stride_ot, stride_oh, LAT, ROPE, BLOCK_H, BLOCK_N)),
    ], [4, 4], [MATH_REGS, MATH_REGS])  # fmt: skip


def supported(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether :func:`sparse_mla_prefill_ws` takes these operands: Hopper, a 16-bit cache of
    the query's dtype, a rope width of 64 (the tile's keys) and a latent width of 128, 256
    or 512 (halves of whole copy chunks, a value MMA of at most 256 columns)."""
    cap = capability(q_lat.device)
    if cap is None or cap[0] != 9:
        return False
    lat, rope = q_lat.shape[-1], q_pe.shape[-1]
    return (
        q_lat.dtype in (torch.bfloat16, torch.float16)
        and cache.dtype == q_lat.dtype == q_pe.dtype
        and rope == BLOCK_N and lat in (128, 256, 512) and cache.shape[-1] == lat + rope
    )  # fmt: skip


def launch_constexprs(lat: int, rope: int) -> dict[str, object]:
    """The kernel's compile-time arguments (shared with tools/sm90_report)."""
    return dict(LAT=lat, ROPE=rope, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
                LOADER_THREADS=WARPS * 32, MATH_REGS=MATH_REGS)  # fmt: skip


def sparse_mla_prefill_ws(
    q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
    ncand: torch.Tensor, scale: float, num_tokens: int, out: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Launch the kernel (the caller checked :func:`supported` and the operands; ``scale``
    as :func:`~pdserve.kernels.sparse_mla_prefill.sparse_mla_prefill` takes it)."""
    _, num_heads, lat = q_lat.shape
    if num_tokens == 0:
        return out
    grid = (num_tokens, triton.cdiv(num_heads, BLOCK_H))
    _gluon_ws_kernel[grid](
        q_lat, q_pe, cache, rows, ncand, out, scale * LOG2E, num_heads,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(1),
        rows.stride(0), out.stride(0), out.stride(1),
        **launch_constexprs(lat, q_pe.shape[-1]), num_warps=WARPS, maxnreg=MAXNREG,
    )  # fmt: skip
    return out
