"""MTP drafting: the model's own multi-token-prediction layers (DeepSeek-V3, GLM-5).

After each target step, on the device, with no host sync:

- **step 0** runs the MTP layer over every token the target step computed, at the same
  positions and with the same attention metadata (the MTP layer has its own caches in
  the same block tables): slot i takes the target's post-norm hidden state h_i and the
  token that follows position i (the next prompt token inside a chunk, or the token the
  step accepted there; rejected rows get whatever, and are recomputed next step). This
  keeps the MTP caches filled for every computed position, prompt chunks included, so
  they travel with the target's KV in P/D. The draft of each request comes from the row
  of its last accepted token.
- **steps 1 .. k-1** run one row per request: the previous draft as input, the MTP
  layer's own post-norm hidden state recycled, position + 1, the MTP KV written at that
  position (the scheduler allocated k lookahead slots; positions past them or past
  ``max_model_len``, and requests that sampled nothing, write the null slot). With
  ``index_share_for_mtp_iteration`` these steps neither score nor write indexer keys:
  they attend within the selection step 0 made for the request's last accepted token.

Drafts are the MTP logits' argmax; MTP layer ``j % num_nextn_predict_layers`` makes draft j.
Everything here is capture-safe (no host sync, shapes fixed by the batch), so after a
uniform step replayed from a CUDA graph the whole proposal replays from one too
(:mod:`pdserve.runner.draft_graph`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdserve.forward_context import KVCaches, set_forward_context
from pdserve.layers.attention import CommonAttentionMetadata
from pdserve.spec_decode.proposer import DraftBatch


class MTPProposer:
    def __init__(
        self,
        model: Any,  # a CausalLM with mtp_hidden / compute_logits (DeepseekV3ForCausalLM)
        num_speculative_tokens: int,
        backends: dict[str, Any],
        kv_caches: Callable[[], KVCaches],
        max_model_len: int,
        share_topk: bool,
    ) -> None:
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.backends = backends
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.share_topk = share_topk

    def _run(self, common: CommonAttentionMetadata, fn: Callable[[], Any]) -> Any:
        md = {g: b.build_metadata(common) for g, b in self.backends.items()}
        with set_forward_context(self.backends, md, self.kv_caches()):
            return fn()

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        common = batch.common
        assert common is not None and batch.input_ids is not None and batch.positions is not None
        assert batch.first_token is not None
        assert batch.last_next_ids is not None and batch.block_tables is not None
        t = common.num_actual_tokens
        n = len(batch.req_ids)
        dev = batch.sampled.device
        ids, positions = batch.input_ids[:t], batch.positions[:t]
        samples = batch.sample_mask
        if samples is None:
            samples = torch.from_numpy(batch.samples).to(dev, non_blocking=True)
        # step 0: the token after each position
        nxt = torch.cat([ids[1:], ids.new_zeros(1), ids.new_zeros(1)])  # [t + 1 scratch]
        last = common.query_start_loc[1 : n + 1].to(torch.int64) - 1
        nxt.scatter_(0, last, batch.last_next_ids)
        j = torch.arange(batch.sampled.shape[1], device=dev)
        rows = batch.first_token[:, None] + j[None, :]
        ok = (j[None, :] < batch.num_sampled[:, None]) & samples[:, None]
        dst = torch.where(ok, rows, t).flatten()
        nxt.scatter_(0, dst, torch.where(ok, batch.sampled, 0).flatten())
        model = self.model
        h0, topk0 = self._run(
            common, lambda: model.mtp_hidden(nxt[:t], positions, batch.hidden[:t], 0)
        )
        src = batch.first_token + batch.num_sampled - 1  # each request's last accepted row
        h = h0[src]
        draft = self.logits(h).argmax(dim=-1)
        drafts = [draft]
        shared = topk0[src] if self.share_topk and topk0 is not None else None
        base = positions[src]
        k = self.num_speculative_tokens
        m = k if batch.num_drafts is None else max(1, min(batch.num_drafts, k))
        for step in range(1, m):
            pos = base + step
            md = self._draft_metadata(batch, pos, samples, common.max_seq_len + step)
            p = pos.clamp(max=self.max_model_len - 1)

            def one(
                p: torch.Tensor = p, d: torch.Tensor = draft, h: torch.Tensor = h, s: int = step
            ) -> Any:
                return model.mtp_hidden(d, p, h, s, shared)

            h, _ = self._run(md, one)
            draft = self.logits(h).argmax(dim=-1)
            drafts.append(draft)
        out = torch.stack(drafts, dim=1)
        if m < k:  # none past the m proposed
            out = torch.cat([out, out.new_full((out.shape[0], k - m), -1)], dim=1)
        return torch.where(samples[:, None], out, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of MTP hidden states (the target's LM head)."""
        return self.model.compute_logits(hidden)

    def _draft_metadata(
        self, batch: DraftBatch, pos: torch.Tensor, samples: torch.Tensor, max_seq: int
    ) -> CommonAttentionMetadata:
        """One query per request at ``pos`` (its MTP KV written there, or to the null slot)."""
        assert batch.common is not None and batch.block_tables is not None
        n = pos.shape[0]
        dev = pos.device
        bs = batch.common.block_size
        bt = batch.block_tables
        col = (pos // bs).clamp(max=bt.shape[1] - 1)
        slots = bt[torch.arange(n, device=dev), col].to(torch.int64) * bs + pos % bs
        writable = samples & (pos < self.max_model_len) & (pos // bs < bt.shape[1])
        seq = (pos + 1).clamp(max=self.max_model_len)
        return CommonAttentionMetadata(
            num_reqs=n,
            num_actual_tokens=n,
            max_query_len=1,
            max_seq_len=min(max_seq + 1, self.max_model_len),
            block_size=bs,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            seq_lens=seq.to(torch.int32),
            block_tables=bt,
            slot_mapping=torch.where(writable, slots, 0),
            token_req_idx=torch.arange(n, device=dev),
            token_q_idx=torch.zeros(n, dtype=torch.int64, device=dev),
        )
