"""Full-forward CUDA graphs for uniform decode batches.

A uniform decode batch has every request computing the same ``q_len`` tokens (1, or
1+k when verifying k drafts). Its whole forward (model + logits of every token) is
captured once per key ``(padded batch size, q_len, width)``, largest first, all
graphs sharing one memory pool. ``width`` is the ``max_seq_len`` the graph was captured
at: ``max_model_len``, and narrower widths where an attention backend asks for them
(``graph_context_widths``: the DSA indexer's work in a graph grows with it); a step
replays the narrowest graph its longest context fits. At run time the batch is padded
up to the next captured size with dummy requests on the null block
(:meth:`InputBuffers.fill_padding`); the runner takes the hidden states and logits of
the real rows from the graph's static outputs.

Contract with the runner: every input the graph reads is a static device buffer of
:class:`~pdserve.runner.input_buffers.InputBuffers`; a replay only rewrites their
contents. Contract with the attention backends: ``supports_cuda_graphs`` is True and
``prepare_for_capture`` sized their workspaces before the first capture.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from pdserve.runner.model_step import ModelStep

logger = logging.getLogger(__name__)


class CudaGraphManager:
    def __init__(
        self, step: ModelStep, capture_sizes: list[int], query_lens: tuple[int, ...] = (1,)
    ) -> None:
        self.step = step
        self.sizes = sorted(capture_sizes)
        self.query_lens = query_lens
        widths = {
            w for b in step.backends.values() for w in b.graph_context_widths(step.max_model_len)
        }
        self.widths = sorted(w for w in widths | {step.max_model_len} if w <= step.max_model_len)
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool: Any = None  # the graphs' shared memory pool handle
        self.capture_seconds = 0.0

    def padded_size(self, num_reqs: int, q_len: int) -> int | None:
        """The captured batch size a uniform batch runs at, or None (then it runs eagerly)."""
        if q_len not in self.query_lens:
            return None
        i = bisect.bisect_left(self.sizes, num_reqs)
        if i == len(self.sizes):
            return None
        return self.sizes[i] if (self.sizes[i], q_len, self.widths[-1]) in self.graphs else None

    def width_for(self, max_seq_len: int | None) -> int:
        """The narrowest captured width a step whose longest context is ``max_seq_len``
        fits (None: the widest, as under a DP plan, where ranks must agree)."""
        if max_seq_len is None:
            return self.widths[-1]
        return self.widths[min(bisect.bisect_left(self.widths, max_seq_len), len(self.widths) - 1)]

    def _forward(self, padded: int, q_len: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.step
        common = s.buffers.common_metadata(padded, padded * q_len, q_len, width)
        hidden = s.hidden(common)
        return hidden, s.logits(hidden)

    @torch.inference_mode()
    def capture_all(self) -> None:
        s = self.step
        t0 = time.perf_counter()
        for q_len in self.query_lens:
            for group, backend in s.backends.items():
                backend.prepare_for_capture(
                    self.sizes[-1], q_len, s.group_layers[group], s.device, s.max_model_len
                )
        keys = [
            (size, q_len, width)
            for q_len in self.query_lens
            for size in reversed(self.sizes)
            for width in reversed(self.widths)
            # more tokens than a step may hold: such a batch never comes
            if size * q_len <= s.buffers.max_num_tokens
        ]
        for key in keys:
            size, q_len, width = key
            s.buffers.fill_padding(0, 0, size, q_len)
            self._forward(*key)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize(s.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self._forward(*key)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[key] = g
            self.outputs[key] = out
        torch.cuda.synchronize(s.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs in %.1fs", len(self.graphs), self.capture_seconds)

    def replay(self, padded: int, q_len: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph for (``padded``, ``q_len``, ``width``) after
        :meth:`InputBuffers.fill_padding`; returns its static (hidden states, logits) of
        all ``padded * q_len`` tokens."""
        key = (padded, q_len, width)
        self.graphs[key].replay()
        return self.outputs[key]
