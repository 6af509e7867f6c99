"""Build attention metadata and KV caches for model tests (trivial block allocation).

Request ``b`` owns blocks ``1 + b*blocks_per_req ... `` (block 0 is the null
block and is never handed out), so sequences span several blocks and no two
requests share one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from pdserve.forward_context import KVCaches, set_forward_context
from pdserve.layers.attention import CommonAttentionMetadata
from pdserve.runner.model_step import collect_cache_layers


def model_caches(model: torch.nn.Module, num_blocks: int, block_size: int) -> KVCaches:
    """Zeroed caches for every cache layer ``model`` declares, in its parameters' dtype."""
    p = next(model.parameters())
    cfg, _ = collect_cache_layers(model, block_size, str(p.dtype).removeprefix("torch."))
    return KVCaches.allocate(cfg, num_blocks, p.device)


class PagedKV:
    """The model's KV caches (every cache group it declares) plus a fixed block table
    per request, and one backend per group (``backend``: the --attention-backend choice)."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_reqs: int,
        max_seq_len: int,
        block_size: int = 4,
        backend: str = "torch",
    ) -> None:
        p = next(model.parameters())
        device = p.device
        cfg, layers = collect_cache_layers(model, block_size, str(p.dtype).removeprefix("torch."))
        self.backends = {
            g: mods[0].make_backend(backend, device, max_seq_len) for g, mods in layers.items()
        }
        self.block_size = block_size
        self.blocks_per_req = -(-max_seq_len // block_size)
        num_blocks = 1 + num_reqs * self.blocks_per_req
        self.caches = KVCaches.allocate(cfg, num_blocks, device)
        self.kv_caches = [c for _, _, c in self.caches.layers()]
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
        common = self.metadata(num_computed, num_new)
        md = {g: b.build_metadata(common) for g, b in self.backends.items()}
        with set_forward_context(self.backends, md, self.caches):
            yield
