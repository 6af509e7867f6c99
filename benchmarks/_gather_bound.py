"""The gather bound of the sparse MLA kernels: a kernel that only reads each token's
candidate cache rows (the rows the attention kernels gather, same ``rows`` / ``ncand``
tensors from ``candidate_rows``) and sums them, so its time is what moving those bytes
from L2 or HBM into the multiprocessors costs, with no MMA or softmax. The attention
kernel's time over this one is its share of that bound.

With 64 heads a gathered row of 576 bf16 values (1,152 bytes) carries 64 x 1,088 x 2 =
139K FLOP, 121 FLOP a byte: at the H200's bf16 matmul rate (~780 TFLOP/s) the attention
would need ~6.5 TB/s of gathered rows, so it is bounded by the gather, not the tensor
cores, unless the gather runs past ~3.2 TB/s for half that rate.

Import it after ``TRITON_INTERPRET`` is set (the CPU smoke run): the decorator reads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_kernel(
    cache_ptr, rows_ptr, ncand_ptr, out_ptr, stride_cs, stride_rt,
    LAT: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(ncand_ptr + t)
    cols = tl.arange(0, LAT)
    rcols = tl.arange(0, ROPE)
    acc = tl.zeros([BLOCK_N, LAT], tl.float32)
    acc_r = tl.zeros([BLOCK_N, ROPE], tl.float32)
    for j0 in range(0, n, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        r = tl.load(rows_ptr + t * stride_rt + j, mask=j < n, other=-1)
        ok = r >= 0
        base = cache_ptr + tl.where(ok, r, 0).to(tl.int64) * stride_cs
        acc += tl.load(base[:, None] + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        acc_r += tl.load(base[:, None] + LAT + rcols[None, :], mask=ok[:, None], other=0.0).to(
            tl.float32
        )
    tl.store(out_ptr + t, tl.sum(tl.sum(acc, axis=1), axis=0) + tl.sum(tl.sum(acc_r, 1), 0))


# (keys a tile, warps, stages): the faster one counts
CONFIGS = ((32, 8, 3), (64, 8, 2))


def gather_rows(cache: torch.Tensor, rows: torch.Tensor, ncand: torch.Tensor, num_tokens: int,
                lat: int, rope: int, config: tuple[int, int, int] = CONFIGS[0],
                out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Sum of each token's candidate rows (float32 [num_tokens]): the reference is
    ``cache.view(-1, width)[rows[t, :ncand[t]]]`` summed, a row of -1 counting zero."""
    block_n, warps, stages = config
    flat = cache.view(-1, cache.shape[-1])
    if out is None:
        out = torch.empty(num_tokens, dtype=torch.float32, device=cache.device)
    if num_tokens:
        _gather_kernel[(num_tokens,)](
            flat, rows, ncand, out, flat.stride(0), rows.stride(0), LAT=lat, ROPE=rope,
            BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out


def gather_reference(cache: torch.Tensor, rows: torch.Tensor, ncand: torch.Tensor,
                     num_tokens: int) -> torch.Tensor:  # fmt: skip
    flat = cache.view(-1, cache.shape[-1]).float()
    out = torch.zeros(num_tokens, dtype=torch.float32, device=cache.device)
    for t in range(num_tokens):
        r = rows[t, : int(ncand[t])]
        r = r[r >= 0]
        out[t] = flat[r].sum()
    return out
