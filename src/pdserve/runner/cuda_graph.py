"""Full-forward CUDA graphs for uniform decode batches.

A uniform decode batch has every request computing the same ``q_len`` tokens (1 now,
1+k with speculative decoding). Its whole forward (model + logits of each request's
last token) is captured once per key ``(padded batch size, q_len)``, largest first,
all graphs sharing one memory pool. At run time the batch is padded up to the next
captured size with dummy requests that live on the null block (block 0): their
tokens write slot 0, their block-table rows are 0, and their context is ``q_len``
tokens of that block, so they read only memory nothing real uses. Their logits are
dropped.

Contract with the runner: every input the graph reads is a static device buffer the
runner owns (ids, positions, slot mapping, query start locations, sequence lengths,
block tables, logits indices); a replay only rewrites their contents. Contract with
the attention backend: ``supports_cuda_graphs`` is True and ``prepare_for_capture``
sized its workspaces before the first capture.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdserve.layers.attention import CommonAttentionMetadata
from pdserve.runner.forward_context import set_forward_context

if TYPE_CHECKING:
    from pdserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class CudaGraphManager:
    def __init__(
        self, runner: ModelRunner, capture_sizes: list[int], query_lens: tuple[int, ...] = (1,)
    ) -> None:
        self.runner = runner
        self.sizes = sorted(capture_sizes)
        self.query_lens = query_lens
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.pool: Any = None  # the graphs' shared memory pool handle
        self.capture_seconds = 0.0

    def padded_size(self, num_reqs: int, q_len: int) -> int | None:
        """The captured batch size a uniform batch runs at, or None (then it runs eagerly)."""
        if q_len not in self.query_lens:
            return None
        i = bisect.bisect_left(self.sizes, num_reqs)
        if i == len(self.sizes):
            return None
        return self.sizes[i] if (self.sizes[i], q_len) in self.graphs else None

    # -- padding --------------------------------------------------------------------------
    def fill_padding(self, num_reqs: int, num_tokens: int, padded: int, q_len: int) -> None:
        """Write dummy requests ``num_reqs..padded`` into the static buffers (host, then device)."""
        r = self.runner
        pt = padded * q_len
        if padded > num_reqs:
            extra = padded - num_reqs
            qsl = r.h_qsl.numpy()
            qsl[num_reqs + 1 : padded + 1] = num_tokens + q_len * np.arange(1, extra + 1)
            r.h_seq_lens.numpy()[num_reqs:padded] = q_len
            nblk = -(-q_len // r.block_size)  # the dummies' context: q_len tokens of block 0
            r.h_block_tables.numpy()[num_reqs:padded, :nblk] = 0
            r.h_logits_idx.numpy()[num_reqs:padded] = qsl[num_reqs + 1 : padded + 1] - 1
            for h, d, lo, hi in (
                (r.h_qsl, r.d_qsl, num_reqs + 1, padded + 1),
                (r.h_seq_lens, r.d_seq_lens, num_reqs, padded),
                (r.h_logits_idx, r.d_logits_idx, num_reqs, padded),
            ):
                d[lo:hi].copy_(h[lo:hi], non_blocking=True)
            r.d_block_tables[num_reqs:padded, :nblk].copy_(
                r.h_block_tables[num_reqs:padded, :nblk], non_blocking=True
            )
        if pt > num_tokens:
            for h, d in (
                (r.h_input_ids, r.d_input_ids),
                (r.h_positions, r.d_positions),
                (r.h_slots, r.d_slots),
            ):
                h.numpy()[num_tokens:pt] = 0
                d[num_tokens:pt].copy_(h[num_tokens:pt], non_blocking=True)
            r.h_positions.numpy()[num_tokens:pt] = np.tile(
                np.arange(q_len), (pt - num_tokens) // q_len
            )
            r.d_positions[num_tokens:pt].copy_(r.h_positions[num_tokens:pt], non_blocking=True)

    def padded_metadata(self, padded: int, q_len: int) -> CommonAttentionMetadata:
        """Metadata viewing the static buffers for a padded uniform batch."""
        r = self.runner
        pt = padded * q_len
        return CommonAttentionMetadata(
            num_reqs=padded,
            num_actual_tokens=pt,
            max_query_len=q_len,
            max_seq_len=r.max_model_len,
            block_size=r.block_size,
            query_start_loc=r.d_qsl[: padded + 1],
            seq_lens=r.d_seq_lens[:padded],
            block_tables=r.d_block_tables[:padded],
            slot_mapping=r.d_slots[:pt],
            token_req_idx=r.d_req_idx[:pt],
            token_q_idx=r.d_q_idx[:pt],
        )

    def _forward(self, padded: int, q_len: int) -> torch.Tensor:
        r = self.runner
        md = r.backend.build_metadata(self.padded_metadata(padded, q_len))
        pt = padded * q_len
        with set_forward_context(r.backend, md, r.kv_caches):
            hidden = r.model(r.d_input_ids[:pt], r.d_positions[:pt])
        return r.model.compute_logits(hidden[r.d_logits_idx[:padded]])

    # -- capture and replay ---------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self) -> None:
        r = self.runner
        t0 = time.perf_counter()
        hc = r.hf_config
        for q_len in self.query_lens:
            r.backend.prepare_for_capture(
                self.sizes[-1],
                q_len,
                int(hc.num_attention_heads),
                int(hc.num_key_value_heads),
                int(hc.head_dim),
                r.device,
                r.max_model_len,
            )
        for q_len in self.query_lens:
            for size in reversed(self.sizes):
                self.fill_padding(0, 0, size, q_len)
                self._forward(size, q_len)  # warm-up: compiles kernels, settles allocations
                torch.cuda.synchronize(r.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = self._forward(size, q_len)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[(size, q_len)] = g
                self.logits[(size, q_len)] = out
        torch.cuda.synchronize(r.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs in %.1fs", len(self.graphs), self.capture_seconds)

    def replay(self, padded: int, q_len: int) -> torch.Tensor:
        """Replay the graph for (``padded``, ``q_len``) after :meth:`fill_padding`; returns its
        static logits buffer (all ``padded`` rows)."""
        self.graphs[(padded, q_len)].replay()
        return self.logits[(padded, q_len)]
