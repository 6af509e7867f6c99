"""Sparse MLA prefill for Hopper written in Gluon (issue 26): explicit buffers, one block
of gathered cache rows in flight while the previous one is computed.

The Triton prefill kernel (:mod:`pdserve.kernels.sparse_mla_prefill`) leaves the tile
pipeline to Triton's software pipeliner. For a 64-key tile with all 64 heads of a token
the query (73.7 KB) and two tiles of gathered rows (2 x 73.7 KB) fill the
multiprocessor's shared memory, and the pipeliner then waits for every copy in flight
before each tile (``cp.async.wait_group 0``, tools/sm90_report.py): each tile's gather
from L2 is exposed. Here the schedule is written out (Gluon: Triton's lower level, with
layouts, shared memory and asynchronous copies in the program):

- one program per (token, 64 heads), 8 warps; the query's latent and rope parts and two
  buffers of ``BLOCK_N`` gathered cache rows live in shared memory;
- step ``i`` waits for tile ``i``'s copies, issues the score MMAs
  (``S = Q_lat K_lat^T + Q_rope K_rope^T``), then waits only for the previous step's
  value MMA, so the buffer that step read is free, and issues the copies of tile
  ``i + 1`` into it: they land while tile ``i``'s softmax and value MMA run;
- the probabilities go through shared memory (``P``, 8 KB) to the value MMA,
  ``O += P V`` with ``V`` the tile's latent rows (the same buffer as the keys); the
  value MMA of step ``i`` is left running into step ``i + 1``'s score MMAs.

The candidates are :func:`~pdserve.kernels.sparse_mla_prefill.candidate_rows`' (cache
rows, -1 for none); a row past the count or -1 is copied as zeros (a masked copy) and
scored -inf. Head slots past the model's heads are zero queries, never stored. Each
warpgroup's score MMA is m64n32 (the two warpgroups split a tile's keys) and its value
MMA m64n256 (they split the latent dims).

Needs a CUDA device with compute capability 9.x, a bf16 or fp16 cache of the query's
dtype, a latent width that is a power of two from 64 to 512 and a rope width a power of
two of at least 16 (:func:`supported`); the engine uses the Triton kernel otherwise.
Gluon has no interpreter: the CPU suite compiles this kernel for sm_90a
(tools/sm90_report.py) and the parity tests run on the GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from pdserve.kernels import sparse_mla_gluon_ws
from pdserve.kernels._utils import LOG2E, capability
from pdserve.kernels.sparse_mla_prefill import check_operands

BLOCK_H = 64  # heads a program: the M of a warpgroup MMA
BLOCK_N = 64  # candidate rows a tile
WARPS = 8  # two warpgroups
LAZY_TAU = 8.0  # log2 units: probabilities stay below 2^8 before the 16-bit cast
# the kernel's variants (``variant`` of :func:`sparse_mla_prefill_gluon`): whether the
# accumulator is rescaled at every tile or only when a row's maximum grows past LAZY_TAU;
# "gluon_ws" is the warp-specialized kernel (kernels/sparse_mla_gluon_ws.py) where it
# applies, this one (rescaling every tile) elsewhere
VARIANTS = {"gluon": False, "gluon_lazy": True, "gluon_ws": False}


@gluon.jit
def _gather_tile(
    cache_ptr, rows_ptr, lat_buf, rope_buf, j0, n_cand, stride_cs,
    LAT: gl.constexpr, ROPE: gl.constexpr, BLOCK_N: gl.constexpr, LD: gl.constexpr,
):  # fmt: skip
    """Issue (and commit as one group) the copies of candidates ``j0 .. j0 + BLOCK_N``
    into one buffer; a missing candidate's row is zero-filled."""
    j = j0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    r = gl.load(rows_ptr + j, mask=j < n_cand, other=-1)
    ok = r >= 0
    base = cache_ptr + gl.where(ok, r, 0).to(gl.int64) * stride_cs
    cols = gl.arange(0, LAT, layout=gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(lat_buf, base[:, None] + cols[None, :], mask=ok[:, None])
    rcols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(
        rope_buf, base[:, None] + LAT + rcols[None, :], mask=ok[:, None]
    )
    async_copy.commit_group()


@gluon.jit
def _gluon_prefill_kernel(
    qlat_ptr, qpe_ptr, cache_ptr, rows_ptr, ncand_ptr, out_ptr, qk_scale, num_heads,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_cs, stride_rt, stride_ot, stride_oh,
    LAT: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    LAZY: gl.constexpr, TAU: gl.constexpr,
):  # fmt: skip
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    n_cand = gl.load(ncand_ptr + t)
    n_tiles = gl.cdiv(n_cand, BLOCK_N)
    dt: gl.constexpr = qlat_ptr.dtype.element_ty

    # registers: the scores and the output split between the two warpgroups along N
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, LAT // 2, 16]
    )
    # copies: 16-byte vectors, a warp covers 4 rows x 64 columns
    LD: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[8, 1], order=[1, 0]
    )
    q_lat, q_rope, k_lat, k_rope = sparse_mla_gluon_ws.tile_buffers(dt, LAT, ROPE, BLOCK_H,
                                                                    BLOCK_N)  # fmt: skip
    p_buf = gl.allocate_shared_memory(dt, [BLOCK_H, BLOCK_N],
                                      gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dt))  # fmt: skip

    # the query (head slots past the model's heads are zeros) and tile 0: group 0
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    h_ok = heads < num_heads
    cols = gl.arange(0, LAT, layout=gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(
        q_lat, qlat_ptr + t * stride_qlt + heads[:, None] * stride_qlh + cols[None, :],
        mask=h_ok[:, None],
    )  # fmt: skip
    rcols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(
        q_rope, qpe_ptr + t * stride_qpt + heads[:, None] * stride_qph + rcols[None, :],
        mask=h_ok[:, None],
    )  # fmt: skip
    row_base = rows_ptr + t * stride_rt
    _gather_tile(cache_ptr, row_base, k_lat.index(0), k_rope.index(0), 0, n_cand, stride_cs,
                 LAT, ROPE, BLOCK_N, LD)  # fmt: skip

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    # loop-carried as an MMA result (the value MMA runs on into the next step)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, LAT], gl.float32, layout=O_L))
    s0 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
    key_j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    for i in range(n_tiles):
        b = i % 2
        async_copy.wait_group(0)  # tile i (the only group in flight) has landed
        fence_async_shared()
        gl.thread_barrier()  # ... for every thread's copies
        s = warpgroup_mma(q_lat, k_lat.index(b).permute((1, 0)), s0, use_acc=False,
                          is_async=True)  # fmt: skip
        s = warpgroup_mma(q_rope, k_rope.index(b).permute((1, 0)), s, is_async=True)
        # the previous value MMA (issued before these two) is done: its buffer and P free
        acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
        gl.thread_barrier()  # ... in both warpgroups
        if i + 1 < n_tiles:
            _gather_tile(cache_ptr, row_base, k_lat.index(1 - b), k_rope.index(1 - b),
                         (i + 1) * BLOCK_N, n_cand, stride_cs, LAT, ROPE, BLOCK_N, LD)  # fmt: skip
        j = i * BLOCK_N + key_j
        key_ok = gl.load(row_base + j, mask=j < n_cand, other=-1) >= 0
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where(key_ok[None, :], s * qk_scale, float("-inf"))
        m_tile = gl.maximum(m_i, gl.max(s, axis=1))
        if LAZY:
            # rescale only when some row's maximum outgrows the one in use by more than
            # TAU (one decision for the program); exact: the sum and the accumulator
            # always share the maximum actually used
            grow = gl.max(gl.where(m_tile > m_i + TAU, 1, 0), axis=0)
            if grow > 0:
                alpha = gl.exp2(m_i - gl.where(m_tile == float("-inf"), 0.0, m_tile))
                l_i = l_i * alpha
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                m_i = m_tile
            p = gl.exp2(s - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
            l_i = l_i + gl.sum(p, axis=1)
        else:
            m_use = gl.where(m_tile == float("-inf"), 0.0, m_tile)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_tile
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        p_buf.store(p.to(dt))
        fence_async_shared()
        gl.thread_barrier()  # all of P is written before either warpgroup reads it
        acc = warpgroup_mma(p_buf, k_lat.index(b), acc, is_async=True)

    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)  # tile 0's copies when there was no tile
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    o = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
    oh = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    oc = gl.arange(0, LAT, layout=gl.SliceLayout(0, O_L))
    dst = out_ptr + t * stride_ot + oh[:, None] * stride_oh + oc[None, :]
    gl.store(dst, o.to(dt), mask=(oh < num_heads)[:, None] & (oc[None, :] < LAT))


def _pow2_at_least(x: int, lo: int) -> bool:
    return x >= lo and x & (x - 1) == 0


def supported(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    cache_dtype: torch.dtype | None = None,
) -> bool:
    """Whether :func:`sparse_mla_prefill_gluon` runs these operands (else use the Triton
    kernel): Hopper, a 16-bit cache of the query's dtype, widths the tiles take
    (``cache_dtype``: the cache as it will be, copied to that dtype)."""
    cap = capability(q_lat.device)
    if cap is None or cap[0] != 9:
        return False
    lat, rope = q_lat.shape[-1], q_pe.shape[-1]
    return (
        q_lat.dtype in (torch.bfloat16, torch.float16)
        and (cache_dtype or cache.dtype) == q_lat.dtype == q_pe.dtype
        and _pow2_at_least(lat, 64) and lat <= 512 and _pow2_at_least(rope, 16)
        and cache.shape[-1] == lat + rope
    )  # fmt: skip


def launch_constexprs(lat: int, rope: int, variant: str = "gluon") -> dict[str, object]:
    """The kernel's compile-time arguments (shared with tools/sm90_report)."""
    return dict(LAT=lat, ROPE=rope, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, LAZY=VARIANTS[variant],
                TAU=LAZY_TAU)  # fmt: skip


def sparse_mla_prefill_gluon(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    rows: torch.Tensor,
    ncand: torch.Tensor,
    scale: float,
    num_tokens: int,
    out: torch.Tensor | None = None,
    variant: str = "gluon",
) -> torch.Tensor:
    """:func:`~pdserve.kernels.sparse_mla_prefill.sparse_mla_prefill` (same arguments and
    result) with the Gluon kernel (``variant``: a :data:`VARIANTS` name); raises
    ``ValueError`` where :func:`supported` is false."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: one of {sorted(VARIANTS)}")
    if not supported(q_lat, q_pe, cache):
        raise ValueError("sparse_mla_prefill_gluon: needs sm_90, a bf16/fp16 cache of the "
                         "query's dtype, a latent width 64-512 and a rope width 16+, "
                         "powers of two")  # fmt: skip
    check_operands("sparse_mla_prefill_gluon", q_lat, q_pe, cache, rows, num_tokens)
    _, num_heads, lat = q_lat.shape
    rope = q_pe.shape[-1]
    if out is None:
        out = torch.empty_like(q_lat)
    if num_tokens == 0:
        return out
    if variant == "gluon_ws" and sparse_mla_gluon_ws.supported(q_lat, q_pe, cache):
        return sparse_mla_gluon_ws.sparse_mla_prefill_ws(q_lat, q_pe, cache, rows, ncand, scale,
                                                         num_tokens, out)  # fmt: skip
    grid = (num_tokens, triton.cdiv(num_heads, BLOCK_H))
    _gluon_prefill_kernel[grid](
        q_lat, q_pe, cache, rows, ncand, out, scale * LOG2E, num_heads,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(1),
        rows.stride(0), out.stride(0), out.stride(1),
        **launch_constexprs(lat, rope, variant), num_warps=WARPS,
    )  # fmt: skip
    return out
