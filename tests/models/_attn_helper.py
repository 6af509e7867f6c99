"""Build attention metadata and KV caches for model tests (trivial block allocation).

Request ``b`` owns blocks ``1 + b*blocks_per_req ... `` (block 0 is the null
block and is never handed out), so sequences span several blocks and no two
requests share one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from pdserve.layers.attention import CommonAttentionMetadata, get_attn_backend
from pdserve.runner.forward_context import set_forward_context


class PagedKV:
    """KV caches for every layer plus a fixed block table per request."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_reqs: int,
        max_seq_len: int,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.backend = get_attn_backend("torch")
        self.block_size = block_size
        self.blocks_per_req = -(-max_seq_len // block_size)
        num_blocks = 1 + num_reqs * self.blocks_per_req
        shape = self.backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_tables = (
            1 + torch.arange(num_reqs * self.blocks_per_req, dtype=torch.int32, device=device)
        ).view(num_reqs, self.blocks_per_req)
        self.device = device

    def metadata(
        self, num_computed: Sequence[int], num_new: Sequence[int]
    ) -> CommonAttentionMetadata:
        """One step in which request ``b`` has ``num_computed[b]`` cached tokens and adds ``num_new[b]``."""
        dev = self.device
        seq_lens = [c + n for c, n in zip(num_computed, num_new, strict=True)]
        qsl = [0]
        for n in num_new:
            qsl.append(qsl[-1] + n)
        slots, req_idx, q_idx = [], [], []
        for b, (c, n) in enumerate(zip(num_computed, num_new, strict=True)):
            for i in range(n):
                pos = c + i
                block = int(self.block_tables[b, pos // self.block_size])
                slots.append(block * self.block_size + pos % self.block_size)
                req_idx.append(b)
                q_idx.append(i)
        return CommonAttentionMetadata(
            num_reqs=len(num_new),
            num_actual_tokens=qsl[-1],
            max_query_len=max(num_new),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=self.block_tables[: len(num_new)],
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            token_req_idx=torch.tensor(req_idx, dtype=torch.int64, device=dev),
            token_q_idx=torch.tensor(q_idx, dtype=torch.int64, device=dev),
        )

    @contextlib.contextmanager
    def step(self, num_computed: Sequence[int], num_new: Sequence[int]) -> Iterator[None]:
        """Enter the forward context for one step (see :meth:`metadata`)."""
        md = self.backend.build_metadata(self.metadata(num_computed, num_new))
        with set_forward_context(self.backend, md, self.kv_caches):
            yield
