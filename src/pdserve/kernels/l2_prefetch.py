"""Pull a weight matrix into the GPU's L2 cache ahead of the GEMM that reads it.

A decode step at a small batch alternates bandwidth-bound GEMMs with short
latency-bound stretches (RoPE, the KV write, attention and its split reduce) that
leave DRAM mostly idle. Run on a side stream during such a stretch, this kernel reads
the next GEMM's weight (the attention output projection: 32 MB for Llama-3-8B, the
H100/H200 L2 holds 50 MB) with the ``evict_last`` hint, so the GEMM then reads it from
L2 instead of DRAM. The bytes the step moves from DRAM do not change; the reads move
into time that was idle.

The kernel has no effect on any result: each program folds its chunk into one XOR
word and stores it in ``sink[program]`` (the store keeps the compiler from dropping
the loads; :func:`l2_prefetch_reference` computes the same words, which is what the
parity test checks). The grid is ``num_ctas`` programs, each streaming a contiguous
chunk, so the prefetch occupies a bounded part of the GPU and the latency-bound
kernels it runs beside still find free multiprocessors. No host syncs; graph-safe.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import check_device

BLOCK = 8192  # int32 words per program and iteration (32 KB in flight per program)


@triton.jit
def _l2_prefetch_kernel(x_ptr, sink_ptr, n_words, words_per_cta, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * words_per_cta
    end = tl.minimum(start + words_per_cta, n_words)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        acc ^= tl.load(x_ptr + offs, mask=offs < end, other=0, eviction_policy="evict_last")
    tl.store(sink_ptr + pid, tl.xor_sum(acc, axis=0))


BULK_CHUNK = 65536  # bytes per cp.async.bulk.prefetch instruction
LINE = 128  # bytes per prefetch.global instruction (one L2 line)
ISSUE_BLOCK = 128  # instructions per program


@triton.jit
def _l2_issue_kernel(
    x_ptr, sink_ptr, n_bytes, CHUNK: tl.constexpr, BULK: tl.constexpr, ISSUE_BLOCK: tl.constexpr
):
    """Fire-and-forget prefetch (sm_90): one instruction per CHUNK bytes, no registers
    waiting for data; ``sink[program]`` gets 0."""
    pid = tl.program_id(0)
    offs = (pid * ISSUE_BLOCK + tl.arange(0, ISSUE_BLOCK)).to(tl.int64) * CHUNK
    ok = offs < n_bytes
    offs = tl.where(ok, offs, 0)
    if BULK:
        size = tl.where(ok, tl.minimum(n_bytes - offs, CHUNK), 16).to(tl.int32)
        r = tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,r",
            [x_ptr + offs, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        r = tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [x_ptr + offs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    tl.store(sink_ptr + pid, tl.xor_sum(r, axis=0))


def l2_prefetch_issue(t: torch.Tensor, sink: torch.Tensor, bulk: bool) -> None:
    """Experimental: prefetch ``t`` with PTX prefetch instructions (sm_90)."""
    b = t.view(-1).view(torch.uint8)
    n = b.numel()
    if n % 16:
        raise ValueError("l2_prefetch_issue needs a whole number of 16-byte units")
    chunk = BULK_CHUNK if bulk else LINE
    grid = triton.cdiv(triton.cdiv(n, chunk), ISSUE_BLOCK)
    if sink.numel() < grid:
        raise ValueError(f"sink needs {grid} words")
    _l2_issue_kernel[(grid,)](
        b, sink, n, CHUNK=chunk, BULK=bulk, ISSUE_BLOCK=ISSUE_BLOCK, num_warps=4
    )


def _words(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 4:
        raise ValueError("l2_prefetch needs a contiguous tensor of whole 4-byte words")
    return t.view(-1).view(torch.int32)


def words_per_cta(n_words: int, num_ctas: int) -> int:
    """Each program's chunk: the words split evenly, rounded up to whole iterations."""
    per = -(-n_words // num_ctas)
    return -(-per // BLOCK) * BLOCK


def l2_prefetch(t: torch.Tensor, sink: torch.Tensor) -> None:
    """Read all of ``t`` through L2 with ``sink.numel()`` programs; ``sink`` (int32)
    receives one XOR word per program."""
    check_device(t, "l2_prefetch")
    if sink.dtype != torch.int32 or sink.dim() != 1 or sink.numel() == 0:
        raise ValueError("l2_prefetch needs a non-empty 1-D int32 sink")
    words = _words(t)
    n, ctas = words.numel(), sink.numel()
    _l2_prefetch_kernel[(ctas,)](words, sink, n, words_per_cta(n, ctas), BLOCK=BLOCK, num_warps=8)


def l2_prefetch_reference(t: torch.Tensor, num_ctas: int) -> torch.Tensor:
    """The words :func:`l2_prefetch` stores: XOR of each program's chunk."""
    words = _words(t).cpu().numpy()
    per = words_per_cta(words.size, num_ctas)
    out = [np.bitwise_xor.reduce(words[i * per : (i + 1) * per]) for i in range(num_ctas)]
    return torch.tensor(np.array(out, dtype=np.int32))
