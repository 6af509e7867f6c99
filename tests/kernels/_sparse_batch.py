"""A random paged batch for the MLA and DSA-indexer kernel tests: requests with their
own shuffled blocks (block 0 stays the null block), query rows at the end of each
context, and the step's CommonAttentionMetadata (optionally padded)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.layers.attention.backend import CommonAttentionMetadata


@dataclass
class SparseBatch:
    md: CommonAttentionMetadata
    positions: torch.Tensor  # [T] position of each real token in its request
    req: torch.Tensor  # [T] request of each real token
    num_blocks: int

    def random_topk(self, k: int, g: torch.Generator, pad_to: int | None = None) -> torch.Tensor:
        """Per token up to ``k`` distinct causal positions in random order, -1 after."""
        t = self.positions.shape[0]
        out = torch.full((pad_to or t, k), -1, dtype=torch.int64)
        for i in range(t):
            cand = torch.randperm(int(self.positions[i]) + 1, generator=g)[:k]
            out[i, : cand.numel()] = cand
        return out.to(self.md.seq_lens.device)


def sparse_batch(
    seq_lens: list[int], q_lens: list[int], page: int, g: torch.Generator, device: torch.device,
    pad_to: int | None = None,
) -> SparseBatch:  # fmt: skip
    b = len(seq_lens)
    nblk = max(-(-s // page) for s in seq_lens)
    bt = (1 + torch.randperm(b * nblk, generator=g)).view(b, nblk).to(torch.int32)
    qsl, slots, req, qidx, pos = [0], [], [], [], []
    for r, (s, q) in enumerate(zip(seq_lens, q_lens, strict=True)):
        qsl.append(qsl[-1] + q)
        for i in range(q):
            p = s - q + i
            slots.append(int(bt[r, p // page]) * page + p % page)
            req.append(r)
            qidx.append(i)
            pos.append(p)
    t = len(slots)
    pad = max(0, (pad_to or t) - t)
    slots, req_p, qidx_p = slots + [0] * pad, req + [0] * pad, qidx + [0] * pad

    def dev(x: list[int], dt: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(x, dtype=dt, device=device)

    md = CommonAttentionMetadata(
        num_reqs=b,
        num_actual_tokens=t,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=page,
        query_start_loc=dev(qsl, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        block_tables=bt.to(device),
        slot_mapping=dev(slots),
        token_req_idx=dev(req_p),
        token_q_idx=dev(qidx_p),
    )
    return SparseBatch(md, dev(pos), dev(req), 1 + b * nblk)
