"""Arrival counters for kernels whose programs split one output's work and combine the
parts in the same launch: the last program of a group to finish does the combining.

A group (a GEMM output tile's K splits, an attention row's context splits) owns one
int32 counter in a per-device buffer that is zero between launches. Each program stores
its part, then :func:`arrive` counts it (after a barrier, so every thread's stores
come first; acquire-release at GPU scope, so the last arrival sees every other
program's stores) and tells whether it came last. That program reads the parts (from
L2: ``cache_modifier=".cg"``), combines them in a fixed order, whichever program it is,
and :func:`release` puts the counter back to zero for the next launch. No second kernel
and no wait on a kernel boundary; the result does not depend on which program came
last. Kernels run in stream order on one device and each sets its own counters back
before it ends, so every such kernel shares the one buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}
# replaced buffers stay allocated: a CUDA graph captured with one keeps its address
_RETIRED: list[torch.Tensor] = []
MIN_COUNTERS = 4096


def split_counters(dev: torch.device, groups: int) -> torch.Tensor | None:
    """The device's counters (int32, zero between launches), at least ``groups`` of
    them; None while a CUDA graph is being captured and too few were made before it
    (the caller then combines in a separate launch; the eager warm-up run before each
    capture makes them)."""
    key = (dev.type, dev.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < groups:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(groups, 2 * buf.numel() if buf is not None else MIN_COUNTERS),
                          dtype=torch.int32, device=dev)  # fmt: skip
        _COUNTERS[key] = buf
    return buf


@triton.jit
def arrive(cnt_ptr, members):
    """Count this program's arrival at its group's counter once every thread of it has
    stored its part; True in the program that arrives last of ``members``."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == members - 1


@triton.jit
def release(cnt_ptr):
    """The last program's final statement: the group's counter back to zero."""
    tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
