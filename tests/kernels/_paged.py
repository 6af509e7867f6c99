"""Random paged-KV test fixtures: a cache with shuffled block tables (block 0 = null)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.layers.attention.backend import CommonAttentionMetadata


@dataclass
class PagedBatch:
    """A batch whose requests own random, disjoint, non-contiguous blocks."""

    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D], random contents
    block_tables: torch.Tensor  # [B, max_blocks] int32 (unused entries hold 0)
    seq_lens: list[int]
    q_lens: list[int]
    block_size: int

    def slots(self, device: torch.device) -> torch.Tensor:
        """Slot of every new token (the last ``q_lens[b]`` positions of request b)."""
        out = []
        bt = self.block_tables.cpu()
        for b, (n, ql) in enumerate(zip(self.seq_lens, self.q_lens, strict=True)):
            for pos in range(n - ql, n):
                out.append(
                    int(bt[b, pos // self.block_size]) * self.block_size + pos % self.block_size
                )
        return torch.tensor(out, dtype=torch.int64, device=device)

    def common(self, device: torch.device, pad_to: int | None = None) -> CommonAttentionMetadata:
        qsl = [0]
        req_idx: list[int] = []
        q_idx: list[int] = []
        for b, ql in enumerate(self.q_lens):
            qsl.append(qsl[-1] + ql)
            req_idx += [b] * ql
            q_idx += list(range(ql))
        t = qsl[-1]
        slots = self.slots(device)
        if pad_to is not None and pad_to > t:
            pad = pad_to - t
            slots = torch.cat([slots, slots.new_zeros(pad)])
            req_idx += [0] * pad
            q_idx += [0] * pad
        return CommonAttentionMetadata(
            num_reqs=len(self.q_lens),
            num_actual_tokens=t,
            max_query_len=max(self.q_lens),
            max_seq_len=max(self.seq_lens),
            block_size=self.block_size,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            block_tables=self.block_tables,
            slot_mapping=slots,
            token_req_idx=torch.tensor(req_idx, dtype=torch.int64, device=device),
            token_q_idx=torch.tensor(q_idx, dtype=torch.int64, device=device),
        )


def make_paged(
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(need) + spare_blocks
    perm = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
    width = max(max(need), 1) + 1
    bt = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    i = 0
    for b, nb in enumerate(need):
        bt[b, :nb] = torch.tensor(perm[i : i + nb], dtype=torch.int32)
        i += nb
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    return PagedBatch(
        cache.to(dtype).to(device), bt.to(device), list(seq_lens), list(q_lens), block_size
    )


def tol(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for attention outputs of ``dtype``."""
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    if dtype == torch.float16:
        return {"atol": 2e-3, "rtol": 2e-3}
    return {"atol": 1.6e-2, "rtol": 1.6e-2}
