"""Copy KV blocks between two sets of cache segments by address, all in one launch.

The cuda_ipc transport moves a request's blocks out of every layer of the prefill
instance's cache (mapped into this process) into the decode instance's own. A segment
is a contiguous run of ``num_blocks`` equal blocks (one layer, or one of a layer's K
and V halves); the tables give, per segment, its start address on each side and its
block size in units of ``UNIT`` bytes, and ``pairs`` ([2, B] int64) the source and
destination block ids. Program ``(k, s)`` copies block ``pairs[0, k]`` of source
segment ``s`` to block ``pairs[1, k]`` of destination segment ``s``. The address math
is ``transports.block_copy`` 's; its torch reference there (``reference_copy``) is
what the parity tests compare against. Every id was range-checked on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import check_device

_STEP_BYTES = 8192  # bytes one program moves per loop step (default)
_NUM_WARPS = 4


@triton.jit
def _copy_blocks_kernel(
    src_addr_ptr,
    dst_addr_ptr,
    units_ptr,
    pairs_ptr,
    num_pairs,
    UNIT: tl.constexpr,
    CHUNK: tl.constexpr,
    ALIGNED16: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    n = tl.load(units_ptr + s)
    if ALIGNED16:  # the host checked it: exact, and with the pointer hints below it lets
        n = (n // (16 // UNIT)) * (16 // UNIT)  # the compiler pair units (16-B accesses)
    src_byte = tl.load(src_addr_ptr + s) + tl.load(pairs_ptr + k) * n * UNIT
    dst_byte = tl.load(dst_addr_ptr + s) + tl.load(pairs_ptr + num_pairs + k) * n * UNIT
    if UNIT == 8:
        src = src_byte.to(tl.pointer_type(tl.int64))
        dst = dst_byte.to(tl.pointer_type(tl.int64))
    elif UNIT == 4:
        src = src_byte.to(tl.pointer_type(tl.int32))
        dst = dst_byte.to(tl.pointer_type(tl.int32))
    elif UNIT == 2:
        src = src_byte.to(tl.pointer_type(tl.int16))
        dst = dst_byte.to(tl.pointer_type(tl.int16))
    else:
        src = src_byte.to(tl.pointer_type(tl.int8))
        dst = dst_byte.to(tl.pointer_type(tl.int8))
    if ALIGNED16:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    for off in range(0, n, CHUNK):
        o = off + tl.arange(0, CHUNK)
        m = o < n
        tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


def launch_shape(step_bytes: int | None, num_warps: int | None) -> tuple[int, int]:
    """(bytes a loop step, warps a program), the defaults for None; a ValueError for a
    step that is not a power of two in [512, 65536] or warps not in 1, 2, 4, 8, 16."""
    step = _STEP_BYTES if step_bytes is None else step_bytes
    if step < 512 or step > 65536 or step & (step - 1):
        raise ValueError(f"step_bytes must be a power of two in [512, 65536], got {step}")
    warps = _NUM_WARPS if num_warps is None else num_warps
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {warps}")
    return step, warps


def copy_blocks_by_address(
    src_addrs: torch.Tensor,
    dst_addrs: torch.Tensor,
    units: torch.Tensor,
    pairs: torch.Tensor,
    unit: int,
    aligned16: bool = False,
    *,
    step_bytes: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Launch the copy on the current stream (asynchronous). ``src_addrs``,
    ``dst_addrs``, ``units``: int64 [S]; ``pairs``: int64 [2, B]; ``unit``: 1, 2, 4
    or 8 bytes (dividing every address and block size). ``aligned16``: every address
    and block size is a multiple of 16 bytes too (the caller checked), so the kernel
    copies in 16-byte accesses, half the load and store instructions of 8-byte ones.
    ``step_bytes`` (a power of two, 512..65536): bytes a program moves a loop step;
    ``num_warps`` (1, 2, 4, 8 or 16): warps a program (None: 8192 and 4)."""
    step, warps = launch_shape(step_bytes, num_warps)
    check_device(units, "copy_blocks_by_address")
    if unit not in (1, 2, 4, 8):
        raise ValueError(f"unit must be 1, 2, 4 or 8 bytes, got {unit}")
    num_pairs, num_segments = pairs.shape[1], units.numel()
    if num_pairs == 0 or num_segments == 0:
        return
    if num_segments > 65535:
        raise ValueError(f"{num_segments} cache segments (at most 65535 in one launch)")
    pairs = pairs.contiguous()
    _copy_blocks_kernel[(num_pairs, num_segments)](
        src_addrs,
        dst_addrs,
        units,
        pairs,
        num_pairs,
        UNIT=unit,
        CHUNK=step // unit,
        ALIGNED16=aligned16,
        num_warps=warps,
    )
