"""Block-scaled FP8 GEMMs on Hopper, in Gluon (issue 28): prefill-sized and decode-sized.

``y = x W^T`` for activations quantized by their producer
(:class:`~pdserve.kernels.reference.Fp8Activation`: fp8 values, one float32 scale per
token and 128 channels) and fp8 weights with one scale per ``SCALE_N`` x 128 block: the
same product as :func:`~pdserve.kernels.fp8_gemm.block_fp8_gemm`.

Prefill sizes (``_fp8_gemm_kernel``): each 128-wide K step's partial product has to be
scaled (row scale x weight scale) before it joins the float32 accumulator, so Triton
waits for every step's tensor-core MMA before it can issue the next (the H200 measured
the Triton kernel at 42% of the fp8 peak at 8,192 tokens, RESULTS.md run 44). Here the
schedule is explicit (Gluon): step ``k``'s MMA is issued into a fresh accumulator, then the program waits only
for step ``k - 1``'s, frees its stage for the copy of step ``k + STAGES - 1`` and scales
and adds ``k - 1``'s partial on the CUDA cores while ``k``'s MMA runs. Tiles are 128 x 128
(two warpgroups, 64 rows each: m64n128k32 fp8 MMAs), operands arrive through a ring of
``STAGES`` shared-memory stages filled by asynchronous copies, the scales of a step are
loaded one step ahead, and programs walk the tiles in groups of ``GROUP_M`` row tiles.

Decode sizes (``_fp8_gemm_swap_kernel``, up to ``DECODE_MAX_ROWS`` rows): the product
is computed transposed, ``out^T = W X^T``, so 64 weight rows fill the MMA's M and the
batch's 1-64 rows are its N (16-64 wide: no 16-row minimum wasted on the weights'
side); each program streams its weight rows over one split of K through a ring of
``DECODE_STAGES`` tiles, and one launch adds the splits' float32 partials. The weights
are the bytes a decode step reads: the kernel is meant to stream them at the copy rate
(the Triton kernel's 64-row FP8 decode was slower than bf16, RESULTS.md run 44).

Needs compute capability 9.x, ``K`` a multiple of 16 (16-byte rows), weight scales over
whole 128-row tiles and no bias (:func:`supported`); the engine keeps the Triton kernel
otherwise. Gluon has no CPU interpreter: the CPU suite compiles these kernels for sm_90a
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
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from pdserve.kernels._utils import capability, env_choice, num_sms
from pdserve.kernels.fp8_gemm import splitk_sum
from pdserve.kernels.fp8_gemm_gluon_tiles import (
    BLOCK_K,
    BLOCK_M,
    BLOCK_N,
    GROUP_M,
    scale_rows,
    step_mma,
    store_tile,
    tile_at,
    tile_descs,
)
from pdserve.kernels.fp8_gemm_gluon_ws import fp8_gemm_ws
from pdserve.kernels.reference import Fp8Activation

STAGES = 4  # 32 KB a stage
WARPS = 8
# decode-sized batches (the swapped kernel): 64 weight rows a program (the M of one
# warpgroup MMA), the batch's rows as the MMA's N, a deeper ring of weight tiles
DECODE_MAX_ROWS = 64
DECODE_BLOCK_N = 64
DECODE_STAGES = 6  # 6 x 16 KB: two programs a multiprocessor
DECODE_WARPS = 4
# prefill sizes: "tma" (tiles copied by the Tensor Memory Accelerator into a ring of
# TMA_STAGES stages, one mbarrier each), "cp_async" (every thread copies 16-byte pieces)
# or "ws" (warp-specialized and persistent: kernels/fp8_gemm_gluon_ws.py, TMA copies),
# the default: 64-71% of the fp8 peak at 2K-16K tokens against 49-61% for "tma", and
# llama-8b-shape FP8 prefill 8K at 37.7K tok/s against 34.7K (RESULTS.md run 130, H100)
PREFILL_KERNELS = ("tma", "cp_async", "ws")
PREFILL_KERNEL = "ws"
PREFILL_ENV = "PDSERVE_FP8_PREFILL"  # one of PREFILL_KERNELS: the engine's choice instead
TMA_STAGES = 5  # 5 x 32 KB


@gluon.jit
def _issue_step(
    x_ptr, w_ptr, a_buf, b_buf, off_m, off_n, kb, M, N, K, stride_xm, stride_wn,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, LD: gl.constexpr,
):  # fmt: skip
    """Copy K step ``kb``'s [BLOCK_M, BLOCK_K] tile of ``x_ptr`` and [BLOCK_N, BLOCK_K] tile
    of ``w_ptr`` into one stage (zeros past M, N, K) and commit them as one group; a step
    past the last (``K``: where this program's range ends) is an empty group, so the count
    of groups in flight stays the same."""
    ks = kb * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LD))
    k_ok = ks < K
    rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD))
    async_copy.async_copy_global_to_shared(
        a_buf, x_ptr + rm[:, None].to(gl.int64) * stride_xm + ks[None, :],
        mask=(rm < M)[:, None] & k_ok[None, :],
    )  # fmt: skip
    rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    async_copy.async_copy_global_to_shared(
        b_buf, w_ptr + rn[:, None].to(gl.int64) * stride_wn + ks[None, :],
        mask=(rn < N)[:, None] & k_ok[None, :],
    )  # fmt: skip
    async_copy.commit_group()


@gluon.jit
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om,
    SCALE_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr, GROUP_M: gl.constexpr,
):  # fmt: skip
    off_m, off_n = tile_at(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_steps = gl.cdiv(K, BLOCK_K)

    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_N, 32]
    )
    LD: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[8, 1], order=[1, 0]
    )
    dt: gl.constexpr = x_ptr.dtype.element_ty
    a_bufs = gl.allocate_shared_memory(dt, [STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dt))
    b_bufs = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dt))  # fmt: skip
    for s in gl.static_range(STAGES):
        _issue_step(x_ptr, w_ptr, a_bufs.index(s), b_bufs.index(s), off_m, off_n, s, M, N, K,
                    stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, LD)  # fmt: skip

    xs_rows, m_ok, ws_rows = scale_rows(xs_ptr, ws_ptr, off_m, off_n, M, stride_xsm,
                                        stride_wsn, SCALE_N, BLOCK_M, BLOCK_N, ACC)  # fmt: skip
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=ACC)

    # step 0: its stage landed (the other STAGES - 1 may be in flight)
    async_copy.wait_group(STAGES - 1)
    fence_async_shared()
    gl.thread_barrier()
    part, a_s, b_s = step_mma(a_bufs.index(0), b_bufs.index(0), xs_rows, m_ok, ws_rows, 0, ACC)
    for kb in range(1, k_steps):
        st = kb % STAGES
        async_copy.wait_group(STAGES - 2)  # step kb landed
        fence_async_shared()
        gl.thread_barrier()
        nxt, a_next, b_next = step_mma(a_bufs.index(st), b_bufs.index(st), xs_rows, m_ok,
                                       ws_rows, kb, ACC)  # fmt: skip
        done = warpgroup_mma_wait(num_outstanding=1, deps=(part,))  # step kb - 1
        gl.thread_barrier()  # both warpgroups are done with step kb - 1's stage
        prev = (kb - 1) % STAGES
        _issue_step(x_ptr, w_ptr, a_bufs.index(prev), b_bufs.index(prev), off_m, off_n,
                    kb - 1 + STAGES, M, N, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                    LD)  # fmt: skip
        acc += done * (a_s * b_s)[:, None]
        part = nxt
        a_s = a_next
        b_s = b_next
    done = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
    acc += done * (a_s * b_s)[:, None]
    async_copy.wait_group(0)  # the empty groups past the last step

    store_tile(acc, out_ptr, off_m, off_n, M, N, stride_om, BLOCK_M, BLOCK_N)


@gluon.jit
def _tma_step(a_desc, b_desc, a_buf, b_buf, bar, off_m, off_n, kb, k_steps):
    """Start the copies of K step ``kb``'s tiles of x and W into one stage; they arrive on
    ``bar`` (a step past ``k_steps`` copies nothing). The Tensor Memory Accelerator fills
    rows and columns past the tensors' ends with zeros."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    NBYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    ok = kb < k_steps
    mbarrier.expect(bar, NBYTES, pred=ok)
    tma.async_copy_global_to_shared(a_desc, [off_m, kb * BLOCK_K], bar, a_buf, pred=ok)
    tma.async_copy_global_to_shared(b_desc, [off_n, kb * BLOCK_K], bar, b_buf, pred=ok)


@gluon.jit(do_not_specialize=["M"])  # M % 16 would compile another variant
def _fp8_gemm_tma_kernel(
    a_desc, b_desc, xs_ptr, ws_ptr, out_ptr, M, N, K, stride_xsm, stride_wsn, stride_om,
    SCALE_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
):  # fmt: skip
    """``_fp8_gemm_kernel``'s schedule (step k's MMA issued before step k - 1's partial
    is scaled and added) with its operand tiles copied by the Tensor Memory Accelerator:
    one thread starts a stage's two copies, an mbarrier per stage says when they landed,
    and no thread spends registers or issue slots on addresses."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    off_m, off_n = tile_at(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_steps = gl.cdiv(K, BLOCK_K)

    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_N, 32]
    )
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):
        _tma_step(a_desc, b_desc, a_bufs.index(s), b_bufs.index(s), bars.index(s), off_m, off_n,
                  s, k_steps)  # fmt: skip

    xs_rows, m_ok, ws_rows = scale_rows(xs_ptr, ws_ptr, off_m, off_n, M, stride_xsm,
                                        stride_wsn, SCALE_N, BLOCK_M, BLOCK_N, ACC)  # fmt: skip
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=ACC)

    mbarrier.wait(bars.index(0), phase=0)
    part, a_s, b_s = step_mma(a_bufs.index(0), b_bufs.index(0), xs_rows, m_ok, ws_rows, 0, ACC)
    for kb in range(1, k_steps):
        st = kb % STAGES
        mbarrier.wait(bars.index(st), phase=(kb // STAGES) & 1)  # step kb's tiles landed
        nxt, a_next, b_next = step_mma(a_bufs.index(st), b_bufs.index(st), xs_rows, m_ok,
                                       ws_rows, kb, ACC)  # fmt: skip
        done = warpgroup_mma_wait(num_outstanding=1, deps=(part,))  # step kb - 1
        gl.thread_barrier()  # both warpgroups are done reading step kb - 1's stage
        prev = (kb - 1) % STAGES
        _tma_step(a_desc, b_desc, a_bufs.index(prev), b_bufs.index(prev), bars.index(prev),
                  off_m, off_n, kb - 1 + STAGES, k_steps)  # fmt: skip
        acc += done * (a_s * b_s)[:, None]
        part = nxt
        a_s = a_next
        b_s = b_next
    done = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
    acc += done * (a_s * b_s)[:, None]
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    store_tile(acc, out_ptr, off_m, off_n, M, N, stride_om, BLOCK_M, BLOCK_N)


@gluon.jit
def _fp8_gemm_swap_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_os, stride_om, steps_per_split,
    SCALE_N: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    """Decode batches: ``out^T = W X^T``, 64 weight rows a program as the MMA's M and the
    batch's rows as its N (m64nBLOCK_Mk32), one split of K a program (partials summed by
    the caller); a ring of STAGES weight tiles in flight."""
    off_n = gl.program_id(0) * BLOCK_N
    split = gl.program_id(1)
    kb0 = split * steps_per_split
    n_steps = gl.minimum(steps_per_split, gl.cdiv(K, BLOCK_K) - kb0)
    k_end = gl.minimum(K, (kb0 + n_steps) * BLOCK_K)  # this split's range ends here
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 32]
    )
    LD: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[4, 1], order=[1, 0]
    )
    dt: gl.constexpr = x_ptr.dtype.element_ty
    w_bufs = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dt))
    x_bufs = gl.allocate_shared_memory(dt, [STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dt))  # fmt: skip
    for s in gl.static_range(STAGES - 1):
        _issue_step(w_ptr, x_ptr, w_bufs.index(s), x_bufs.index(s), off_n, 0, kb0 + s, N, M,
                    k_end, stride_wn, stride_xm, BLOCK_N, BLOCK_M, BLOCK_K, LD)  # fmt: skip
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
    m_ok = rm < M
    xs_cols = xs_ptr + rm.to(gl.int64) * stride_xsm
    gl.static_assert(SCALE_N % BLOCK_N == 0)  # one weight scale a (program, step)
    ws_row = ws_ptr + (off_n // SCALE_N).to(gl.int64) * stride_wsn
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC)
    for i in range(n_steps):
        # the stage of step i - 1 is free: its (synchronous) MMA has completed
        nxt = (i + STAGES - 1) % STAGES
        _issue_step(w_ptr, x_ptr, w_bufs.index(nxt), x_bufs.index(nxt), off_n, 0,
                    kb0 + i + STAGES - 1, N, M, k_end, stride_wn, stride_xm, BLOCK_N, BLOCK_M,
                    BLOCK_K, LD)  # fmt: skip
        xs = gl.load(xs_cols + kb0 + i, mask=m_ok, other=0.0)
        ws = gl.load(ws_row + kb0 + i)
        async_copy.wait_group(STAGES - 1)  # step i landed
        fence_async_shared()
        gl.thread_barrier()
        st = i % STAGES
        part = warpgroup_mma(w_bufs.index(st), x_bufs.index(st).permute((1, 0)),
                             gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC),
                             use_acc=False)  # fmt: skip
        acc += part * (xs * ws)[None, :]
    async_copy.wait_group(0)  # the empty groups past the range
    rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
    dst = out_ptr + split * stride_os + rm[None, :].to(gl.int64) * stride_om + rn[:, None]
    gl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & (rn < N)[:, None])


def supported(x: torch.Tensor | Fp8Activation, w: torch.Tensor, scale_n: int,
              bias: torch.Tensor | None, out_dtype: torch.dtype,
              quantizable: bool = False) -> bool:  # fmt: skip
    """Whether :func:`fp8_gemm_gluon` takes these operands: Hopper, activations quantized
    by their producer (``quantizable``: or a plain activation the caller will quantize),
    weight scales over whole 128-row tiles, ``K`` a multiple of 16, no bias, a 16-bit
    output."""
    fp8 = isinstance(x, Fp8Activation)
    if not (fp8 or quantizable) or bias is not None or scale_n % BLOCK_N:
        return False
    cap = capability(x.device)
    if cap is None or cap[0] != 9:
        return False
    return x.shape[-1] % 16 == 0 and out_dtype in (torch.bfloat16, torch.float16) and (
        w.dtype == torch.float8_e4m3fn
    )


def launch_constexprs(scale_n: int) -> dict[str, int]:
    """The tile kernel's compile-time arguments (shared with tools/sm90_report)."""
    return dict(SCALE_N=scale_n, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                STAGES=STAGES, GROUP_M=GROUP_M)  # fmt: skip


def tma_constexprs(scale_n: int) -> dict[str, int]:
    """The TMA tile kernel's compile-time arguments (its tiles come with the descriptors)."""
    return dict(SCALE_N=scale_n, STAGES=TMA_STAGES, GROUP_M=GROUP_M)


def _tma_ok(*ts: torch.Tensor) -> bool:
    """Whether the Tensor Memory Accelerator can copy tiles of these 2-D tensors: 16-byte
    aligned bases and row strides, contiguous rows."""
    return all(t.data_ptr() % 16 == 0 and t.stride(1) == 1 and t.stride(0) % 16 == 0 for t in ts)


def decode_launch(m: int, n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_M, K splits, K steps a split) of the swapped kernel for ``m`` <= 64 rows:
    the batch rounded up to an MMA width of 16-64, and splits so that about two programs
    run on each multiprocessor."""
    block_m = max(16, triton.next_power_of_2(m))
    steps = triton.cdiv(k, BLOCK_K)
    want = max(1, min(steps, triton.cdiv(2 * sms, triton.cdiv(n, DECODE_BLOCK_N))))
    per = triton.cdiv(steps, want)
    return block_m, triton.cdiv(steps, per), per


def fp8_gemm_gluon(
    x: Fp8Activation,
    w: torch.Tensor,
    w_scale_inv: torch.Tensor,
    scale_n: int,
    out_dtype: torch.dtype,
    prefill_kernel: str | None = None,
) -> torch.Tensor:
    """``x`` [..., K] (fp8 values and group scales) times ``w`` [N, K] fp8 transposed with
    ``w_scale_inv`` [ceil(N / scale_n), ceil(K / 128)]: [..., N] in ``out_dtype``, as
    :func:`~pdserve.kernels.fp8_gemm.block_fp8_gemm` computes it: up to
    ``DECODE_MAX_ROWS`` rows with the swapped kernel (split-K partials summed in one
    launch), more with a 128 x 128 tile kernel (``prefill_kernel``: one of
    :data:`PREFILL_KERNELS`, else ``PDSERVE_FP8_PREFILL``'s, else :data:`PREFILL_KERNEL`;
    "tma" and "ws" fall back to "cp_async" for operands the Tensor Memory Accelerator
    cannot address). Raises ``ValueError`` where :func:`supported` is false
    (bias aside: the caller adds it)."""
    prefill_kernel = env_choice(prefill_kernel, PREFILL_ENV, PREFILL_KERNEL, PREFILL_KERNELS,
                                "prefill_kernel")  # fmt: skip
    if not supported(x, w, scale_n, None, out_dtype):
        raise ValueError("fp8_gemm_gluon: needs sm_90, an Fp8Activation with K a multiple "
                         "of 16, fp8 weights in 128x128 scale blocks and a bf16/fp16 "
                         "output")  # fmt: skip
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    k_steps = triton.cdiv(k, BLOCK_K)
    if w.shape[1] != k or tuple(w_scale_inv.shape) != (triton.cdiv(n, scale_n), k_steps):
        raise ValueError(f"weights {tuple(w.shape)} / scales {tuple(w_scale_inv.shape)} do "
                         f"not fit K {k} in {scale_n}x128 blocks")  # fmt: skip
    x2 = x.q.reshape(-1, k).contiguous()
    m = x2.shape[0]
    xs = x.scale.reshape(m, k_steps).float().contiguous()
    ws = w_scale_inv.float().contiguous()
    wc = w if w.stride(-1) == 1 and w.stride(0) % 16 == 0 else w.contiguous()
    if m == 0:
        return torch.empty(*lead, n, dtype=out_dtype, device=x2.device)
    if m <= DECODE_MAX_ROWS:
        block_m, splits, per = decode_launch(m, n, k, num_sms(x2.device))
        out = torch.empty(splits, m, n, dtype=torch.float32 if splits > 1 else out_dtype,
                          device=x2.device)  # fmt: skip
        _fp8_gemm_swap_kernel[(triton.cdiv(n, DECODE_BLOCK_N), splits)](
            x2, xs, wc, ws, out, m, n, k, x2.stride(0), xs.stride(0), wc.stride(0),
            ws.stride(0), out.stride(0), out.stride(1), per, SCALE_N=scale_n,
            BLOCK_N=DECODE_BLOCK_N, BLOCK_M=block_m, BLOCK_K=BLOCK_K, STAGES=DECODE_STAGES,
            num_warps=DECODE_WARPS,
        )  # fmt: skip
        y = splitk_sum(out, None, out_dtype) if splits > 1 else out[0]
        return y.view(*lead, n)
    out = torch.empty(m, n, dtype=out_dtype, device=x2.device)
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    tma = prefill_kernel != "cp_async" and _tma_ok(x2, wc)
    if tma and prefill_kernel == "ws":
        return fp8_gemm_ws(x2, xs, wc, ws, out, scale_n).view(*lead, n)
    if tma:
        a_desc, b_desc = tile_descs(x2, wc)
        _fp8_gemm_tma_kernel[grid](
            a_desc, b_desc, xs, ws, out, m, n, k, xs.stride(0), ws.stride(0), out.stride(0),
            **tma_constexprs(scale_n), num_warps=WARPS,
        )  # fmt: skip
        return out.view(*lead, n)
    _fp8_gemm_kernel[grid](
        x2, xs, wc, ws, out, m, n, k, x2.stride(0), xs.stride(0), wc.stride(0), ws.stride(0),
        out.stride(0), **launch_constexprs(scale_n), num_warps=WARPS,
    )  # fmt: skip
    return out.view(*lead, n)
