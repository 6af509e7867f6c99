"""CUDA graphs of the MTP proposal, one per captured uniform-batch key.

After a uniform step replays its target graph at padded size P (every request
computing q tokens: 1, or 1+k when verifying), the proposal replays from a graph
captured for the same key: MTP step 0 over the P*q rows, then the k-1 one-row steps.
Its inputs are static: the input buffers (ids, positions, attention metadata, block
tables), the target graph's hidden-state output for that key, and this manager's own
per-request buffers, which :meth:`DraftGraphManager.run` fills from the step's
accepted tokens with device-to-device copies. The P-n dummy rows sample nothing, so
their drafts write only the null slot and are dropped.

Draft graphs share the target graphs' memory pool: graphs replay one at a time, and
every output a later replay reads (the target's hidden states) is held by its graph.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pdserve.runner.cuda_graph import CudaGraphManager
from pdserve.spec_decode.mtp import MTPProposer
from pdserve.spec_decode.proposer import DraftBatch, drafts_to_propose

logger = logging.getLogger(__name__)


class DraftGraphManager:
    def __init__(
        self, proposer: MTPProposer, target: CudaGraphManager, num_spec: int, adaptive: bool
    ) -> None:
        self.proposer = proposer
        self.adaptive = adaptive  # a key verifying j drafts proposes j (drafts_to_propose)
        self.target = target
        s = target.step
        self.buffers = s.buffers
        self.max_model_len = s.max_model_len
        p, dev, i64 = target.sizes[-1], s.device, torch.int64
        self.sampled = torch.full((p, num_spec + 1), -1, dtype=i64, device=dev)
        self.num = torch.ones(p, dtype=i64, device=dev)
        self.samples = torch.zeros(p, dtype=torch.bool, device=dev)
        self.first_token = torch.zeros(p, dtype=i64, device=dev)
        self.next_ids = torch.full((p,), -1, dtype=i64, device=dev)
        self.zeros = torch.zeros(p, dtype=i64, device=dev)
        # a dummy row's first token under each query length: row i starts at token i*q
        self.dummy_first = {q: torch.arange(p, device=dev) * q for q in target.query_lens}
        # keyed as the target's graphs: (padded size, q, width)
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, int], torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.replays = 0

    def _batch(self, size: int, q: int, width: int) -> DraftBatch:
        b = self.buffers
        t = size * q
        common = b.common_metadata(size, t, q, width)
        none = np.zeros(size, dtype=np.int64)
        return DraftBatch(
            req_ids=[""] * size,
            rows=none,
            samples=np.zeros(size, dtype=bool),
            token_table=np.zeros((size, 1), dtype=np.int32),
            num_prompt_tokens=none,
            num_known=none,
            max_context=min(width + 1, self.max_model_len),
            sampled=self.sampled[:size],
            num_sampled=self.num[:size],
            next_positions=self.zeros[:size],
            hidden=self.target.outputs[(size, q, width)][0],
            query_start_loc=common.query_start_loc,
            input_ids=b.input_ids.dev[:t],
            positions=b.positions.dev[:t],
            common=common,
            first_token=self.first_token[:size],
            last_next_ids=self.next_ids[:size],
            block_tables=b.block_tables.dev[:size],
            sample_mask=self.samples[:size],
            num_drafts=drafts_to_propose(q, self.adaptive),
        )

    def _inert(self, lo: int, hi: int, q: int) -> None:
        """Rows ``lo..hi`` sample nothing and point at their own dummy tokens."""
        self.samples[lo:hi] = False
        self.num[lo:hi] = 1
        self.first_token[lo:hi] = self.dummy_first[q][lo:hi]
        self.next_ids[lo:hi] = -1

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one proposal graph per target graph (call right after the target's)."""
        t0 = time.perf_counter()
        dev = self.target.step.device
        for key in sorted(self.target.graphs, reverse=True):
            size, q, width = key
            self.buffers.fill_padding(0, 0, size, q)
            self._inert(0, size, q)
            batch = self._batch(size, q, width)
            self.proposer.propose(batch)  # warm-up
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.target.pool):
                out = self.proposer.propose(batch)
            self.graphs[key] = g
            self.outputs[key] = out
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d MTP draft graphs in %.1fs", len(self.graphs), self.capture_seconds)

    def replay_inert(self, key: tuple[int, int, int]) -> None:
        """Replay the proposal of target graph ``key`` with every row inert: an idle data-
        parallel rank matching its peers' collectives (its drafts are dropped)."""
        self._inert(0, key[0], key[1])
        self.graphs[key].replay()

    def run(
        self,
        key: tuple[int, int, int],  # the target graph the step replayed
        tokens: torch.Tensor,  # [n, w] accepted tokens of the step
        counts: torch.Tensor,  # [n]
        first_token: torch.Tensor,  # [n]
        next_ids: torch.Tensor,  # [n]
        sample_mask: torch.Tensor,  # [n]
    ) -> torch.Tensor:
        """Drafts [n, k] of the step just replayed at target graph ``key``."""
        n, w = tokens.shape
        self.sampled[:n, :w].copy_(tokens)
        self.num[:n].copy_(counts)
        self.samples[:n].copy_(sample_mask)
        self.first_token[:n].copy_(first_token)
        self.next_ids[:n].copy_(next_ids)
        self._inert(n, key[0], key[1])
        self.graphs[key].replay()
        self.replays += 1
        return self.outputs[key][:n].clone()
