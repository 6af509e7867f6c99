"""Forwards a data-parallel rank runs when it has nothing scheduled but a peer has.

Under expert parallelism every MoE layer is a collective over the DP ranks, so in a step
where any rank computes tokens every rank must run a forward with the same collectives
(:mod:`pdserve.distributed.dp_sync` says which). An idle rank runs one of these:

- **eager**: one token at position 0 on the null block (block 0: its KV writes land in
  slot 0, which nothing real reads), the target model, then, when the MTP proposer
  drafts, its ``k`` MTP passes (one MoE layer each), as a busy rank's eager step runs.
  The eager dispatcher takes any token count per rank, so one token is enough.
- **graph**: the agreed (padded batch, q) graph replayed over a batch of dummy requests
  only (:meth:`InputBuffers.fill_padding` from row 0), then, with MTP, the proposal's
  graph for the same key with every row inert, as a busy rank replays both.

Neither touches the scheduler, the input batch or any block but the null block, nor the
static device buffers' contents that a later real step relies on (each step uploads
what it reads). No logits and no sampling: they hold no collective.
"""

from __future__ import annotations

import torch

from pdserve.distributed.dp_sync import StepPlan
from pdserve.forward_context import set_forward_context
from pdserve.layers.attention import CommonAttentionMetadata
from pdserve.runner.cuda_graph import CudaGraphManager
from pdserve.runner.draft_graph import DraftGraphManager
from pdserve.runner.model_step import ModelStep


def plan_graph_key(graphs: CudaGraphManager | None, plan: StepPlan) -> tuple[int, int, int] | None:
    """The graph every rank replays for ``plan`` (the same on every rank: the same
    captures and the same agreed values; the widest width, as no context length is
    agreed), or None: all run eagerly."""
    q = plan.uniform_q
    if graphs is None or q is None or q not in graphs.query_lens:
        return None
    padded = graphs.padded_size(plan.max_reqs, q)
    return (padded, q, graphs.widths[-1]) if padded is not None else None


class DummyStep:
    def __init__(self, step: ModelStep, num_mtp_passes: int) -> None:
        self.step = step
        self.num_mtp_passes = num_mtp_passes  # MTP drafts per step (0: no MTP proposer)
        dev = step.device
        bs = step.kv_cache_config.block_size
        # a block table with the static buffer's row stride (kernels specialise on it)
        table = torch.zeros_like(step.buffers.block_tables.dev[:1])
        self._ids = torch.zeros(1, dtype=torch.int64, device=dev)
        self._common = CommonAttentionMetadata(
            num_reqs=1,
            num_actual_tokens=1,
            max_query_len=1,
            max_seq_len=1,
            block_size=bs,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
            seq_lens=torch.ones(1, dtype=torch.int32, device=dev),
            block_tables=table[:, :1],
            slot_mapping=torch.zeros(1, dtype=torch.int64, device=dev),
            token_req_idx=torch.zeros(1, dtype=torch.int64, device=dev),
            token_q_idx=torch.zeros(1, dtype=torch.int64, device=dev),
        )

    def run_eager(self) -> None:
        s = self.step
        md = {g: b.build_metadata(self._common) for g, b in s.backends.items()}
        ids = pos = self._ids
        assert s.kv_caches is not None, "the KV cache is not allocated yet"
        with set_forward_context(s.backends, md, s.kv_caches):
            hidden = s.model(ids, pos)
            for j in range(self.num_mtp_passes):
                hidden, _ = s.model.mtp_hidden(ids, pos, hidden, j)  # type: ignore[operator]

    def run_graph(
        self,
        graphs: CudaGraphManager,
        draft_graphs: DraftGraphManager | None,
        key: tuple[int, int, int],
    ) -> None:
        """Replay graph ``key`` (padded, q, width) over dummy requests only. The caller owns the
        pinned staging buffers :meth:`InputBuffers.fill_padding` writes (it waits for the
        previous step's uploads first and marks them read after)."""
        self.step.buffers.fill_padding(0, 0, key[0], key[1])
        graphs.replay(*key)
        if draft_graphs is not None and key in draft_graphs.graphs:
            draft_graphs.replay_inert(key)
