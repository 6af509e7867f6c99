"""What each captured decode/verify step costs on the device: the measured verify cost per
(batch, 1 + j) that the adaptive draft policy weighs against the acceptance
(:mod:`pdserve.spec_decode.draft_policy`).

For every target graph ``(padded size, q, width)`` (``q = 1 + j``) the step's cost is the
graph's replay time plus, for ``j > 0``, the replay time of its MTP proposal graph (a step
with ``j = 0`` does not draft). Timing runs once at start-up, right after capture, on a
synthetic batch that reads like a real one at the edge of the graph's width: every
request at context ``width`` (so attention and the indexer read a full context), its
block-table row cycling over the KV pool's blocks (real memory, read only), every token
writing the null slot, and the tokens drawn at random over the vocabulary, so an MoE
routes them over its experts as real traffic does (one token id for all would send every
row to the same top-k experts: a step that reads a few experts' weights instead of most
of them, which made the j > 0 steps look cheap at small batches and dear at large ones:
H200 run 48). Medians of a few replays, timed with CUDA events.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from pdserve.runner.cuda_graph import CudaGraphManager
from pdserve.runner.draft_graph import DraftGraphManager
from pdserve.runner.input_buffers import InputBuffers

REPS = 3


def fill_timing_batch(
    buf: InputBuffers, size: int, q: int, context: int, num_blocks: int, vocab_size: int
) -> None:
    """``size`` requests of ``q`` random tokens at the end of a ``context``-token context
    each, over the pool's blocks 1..num_blocks-1 (read only: every token writes slot 0)."""
    t, bs = size * q, buf.block_size
    nblk = min(-(-context // bs), buf.block_tables.np.shape[1])
    usable = max(1, num_blocks - 1)
    ids = np.arange(size * nblk, dtype=np.int64).reshape(size, nblk) % usable + 1
    buf.block_tables.np[:size, :nblk] = ids
    buf.seq_lens.np[:size] = context
    buf.query_start_loc.np[: size + 1] = np.arange(size + 1) * q
    buf.drafts.np[:size] = -1
    pos = np.tile(context - q + np.arange(q), size)
    buf.positions.np[:t] = pos
    rng = np.random.default_rng(size * 64 + q)  # the same tokens at every start-up
    buf.input_ids.np[:t] = rng.integers(0, vocab_size, t)
    buf.slots.np[:t] = 0
    buf.req_idx.np[:t] = np.repeat(np.arange(size), q)
    buf.q_idx.np[:t] = np.tile(np.arange(q), size)
    for pair, n in (
        (buf.block_tables, size),
        (buf.seq_lens, size),
        (buf.query_start_loc, size + 1),
        (buf.drafts, size),
        (buf.positions, t),
        (buf.input_ids, t),
        (buf.slots, t),
        (buf.req_idx, t),
        (buf.q_idx, t),
    ):
        pair.upload(n)


def _median_seconds(replay: Callable[[], object], device: torch.device) -> float:
    """Median seconds of ``replay()``: CUDA events on a GPU, the host clock elsewhere
    (graphs stood in for on a CPU, in tests)."""
    replay()  # warm: caches, clocks
    times = []
    for _ in range(REPS):
        if device.type != "cuda":
            t0 = time.perf_counter()
            replay()
            times.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


@torch.inference_mode()
def time_step_costs(
    graphs: CudaGraphManager, drafts: DraftGraphManager | None, num_blocks: int
) -> dict[tuple[int, int, int], float]:
    """Seconds per (padded size, drafts j, width) of every captured target graph."""
    s = graphs.step
    out: dict[tuple[int, int, int], float] = {}
    for key in sorted(graphs.graphs):
        size, q, width = key
        fill_timing_batch(s.buffers, size, q, min(width, s.max_model_len), num_blocks,
                          s.vocab_size)  # fmt: skip
        cost = _median_seconds(graphs.graphs[key].replay, s.device)
        if q > 1 and drafts is not None and key in drafts.graphs:
            # every row inert: the proposal's work at this shape, writing only the null slot
            cost += _median_seconds(partial(drafts.replay_inert, key), s.device)
        out[(size, q - 1, width)] = cost
    s.buffers.fill_padding(0, 0, graphs.sizes[-1], 1)  # back to inert dummies
    if s.device.type == "cuda":
        torch.cuda.synchronize(s.device)
    return out
