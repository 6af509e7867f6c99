"""The fused MoE's small steps in one launch each: the token alignment by expert
(:func:`moe_align`) and the per-token sum of its experts' rows (:func:`moe_combine`).

**Align.** :func:`~pdserve.kernels.fused_moe.align_by_expert` (the reference) is about
20 torch ops: a bincount, two prefix sums, an argsort, gathers, a scatter and a
searchsorted; at decode batch sizes each one is a launch that moves a few hundred bytes.
One program does the same here for up to :data:`MAX_ALIGN_PAIRS` (token, slot) pairs and
:data:`MAX_ALIGN_EXPERTS` experts (larger batches keep the torch ops, whose launches
then matter less): per-expert counts (compare-and-sum over chunks of pairs), padded
offsets (prefix sums), the pairs ordered by (expert, pair id) with one register sort of
``expert * BLOCK_N + pair``, each pair's slot from its rank inside its expert, every slot
first set to the padding mark then the pairs scattered in, and each block's expert.
The output equals the reference's exactly (same layout, same order within an expert).

**Combine.** ``out[t] = sum_j rows[t * k + j]`` in float32, rounded once to the output
dtype, plus (``add``: the shared experts' output, rounded as the unfused ``routed +
shared`` rounds it) one more term: what ``per_pair.view(t, k, h).sum(1, dtype=float32)``,
its copy into the output and the layer's ``+ shared`` did in three launches.

No host sync; grids and buffer sizes come from host ints only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import check_device, next_pow2, pdl_args, pdl_enter

MAX_ALIGN_PAIRS = 1024  # a decode batch of 128 tokens at top-8
MAX_ALIGN_EXPERTS = 511  # BLOCK_E = next_pow2(E + 1) <= 512
_CHUNK = 16  # pairs per step of the count
_BLOCK_B = 64  # blocks per step of the block-expert search
_BLOCK_S = 1024  # slots per step of the padding fill


@triton.jit
def _align_kernel(
    ids_ptr,
    pairs_ptr,
    block_expert_ptr,
    n,
    E,
    NB,
    BM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    offs = tl.arange(0, BLOCK_N)
    valid = offs < n
    ids = tl.load(ids_ptr + offs, mask=valid, other=E).to(tl.int32)  # pads: past every expert
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, n, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        ic = tl.load(ids_ptr + p, mask=p < n, other=-1).to(tl.int32)
        counts += tl.sum((ic[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = tl.cumsum(counts, 0) - counts
    sk = tl.sort(ids * BLOCK_N + offs)  # by expert, then by pair id (a stable order)
    se = sk // BLOCK_N
    order = sk % BLOCK_N
    dest = tl.gather(pad_start, se, 0) + offs - tl.gather(start, se, 0)
    total = NB * BM
    for s0 in range(0, total, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        tl.store(pairs_ptr + s, tl.zeros([BLOCK_S], tl.int32) + n, mask=s < total)
    tl.debug_barrier()  # every padding mark lands before a pair overwrites its slot
    tl.store(pairs_ptr + dest, order, mask=valid)
    real = e < E
    for b0 in range(0, NB, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        first = b * BM
        cnt = tl.sum(((pad_end[None, :] <= first[:, None]) & real[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(cnt < E, cnt, -1), mask=b < NB)


def align_fits(num_pairs: int, num_experts: int) -> bool:
    """Whether :func:`moe_align` takes this batch in its one program."""
    return num_pairs <= MAX_ALIGN_PAIRS and num_experts <= MAX_ALIGN_EXPERTS


def moe_align(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`~pdserve.kernels.fused_moe.align_by_expert` returns (sorted_pairs
    [NB * block_m] int32, block_expert [NB] int32), in one launch; the batch must
    :func:`align_fits`."""
    check_device(ids, "moe_align")
    t, k = ids.shape
    n = t * k
    if not align_fits(n, num_experts):
        raise ValueError(f"moe_align takes up to {MAX_ALIGN_PAIRS} pairs and "
                         f"{MAX_ALIGN_EXPERTS} experts ({n}, {num_experts})")  # fmt: skip
    nb = triton.cdiv(n, block_m) + min(num_experts, n)
    pairs = torch.empty(nb * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=ids.device)
    if n == 0:
        return pairs, block_expert
    flat = ids.reshape(-1)
    _align_kernel[(1,)](
        flat, pairs, block_expert, n, num_experts, nb, BM=block_m, BLOCK_N=max(16, next_pow2(n)),
        BLOCK_E=next_pow2(num_experts + 1), CHUNK=_CHUNK, BLOCK_B=_BLOCK_B, BLOCK_S=_BLOCK_S,
        num_warps=4,
        **pdl_args(flat.device),
    )  # fmt: skip
    return pairs, block_expert


@triton.jit
def _combine_kernel(
    rows_ptr,
    add_ptr,
    out_ptr,
    H,
    stride_r,
    stride_a,
    stride_o,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_ADD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(rows_ptr + (t * K + j) * stride_r + cols, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    r = acc.to(dt)
    if HAS_ADD:
        a = tl.load(add_ptr + t * stride_a + cols, mask=m, other=0.0).to(tl.float32)
        r = (r.to(tl.float32) + a).to(dt)
    tl.store(out_ptr + t * stride_o + cols, r, mask=m)


def moe_combine(
    rows: torch.Tensor, k: int, out: torch.Tensor, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``out`` [T, H] = the float32 sum of ``rows`` [T * k, H] over each token's k rows,
    rounded to ``out``'s dtype (plus ``add`` [T, H], rounded again)."""
    check_device(rows, "moe_combine")
    t, h = out.shape
    if rows.shape != (t * k, h) or (add is not None and add.shape != (t, h)):
        raise ValueError(f"moe_combine: rows {tuple(rows.shape)} / add do not fit out {(t, h)}")
    if rows.stride(1) != 1 or out.stride(1) != 1 or (add is not None and add.stride(1) != 1):
        raise ValueError("moe_combine needs unit stride along the hidden dimension")
    if t == 0:
        return out
    block = min(1024, next_pow2(h))
    a = add if add is not None else out
    _combine_kernel[(t, triton.cdiv(h, block))](
        rows, a, out, h, rows.stride(0), a.stride(0), out.stride(0), K=k, BLOCK=block,
        HAS_ADD=add is not None, num_warps=4,
        **pdl_args(rows.device),
    )  # fmt: skip
    return out


def moe_combine_reference(
    rows: torch.Tensor, k: int, out: torch.Tensor, add: torch.Tensor | None = None
) -> torch.Tensor:
    """The unfused ops: the k rows summed in float32, copied into ``out``, ``+ add``."""
    t, h = out.shape
    out.copy_(rows.view(t, k, h).sum(dim=1, dtype=torch.float32))
    if add is not None:
        out.copy_(out + add)
    return out
