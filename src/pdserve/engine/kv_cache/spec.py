"""What the KV cache holds, described per layer group.

Every group shares one block table per request (block ``b`` of a request means
block ``b`` in every group's tensors), but each group says its own bytes per token:
a Llama layer keeps K and V per KV head; a GLM-5 MLA layer keeps one latent vector;
a DSA indexer keeps a small key cache, and index-sharing layers keep none. The
manager only needs the total bytes per block to size the pool.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    name: str
    layer_indices: tuple[int, ...]
    bytes_per_token_per_layer: int


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int
    groups: tuple[KVCacheGroupSpec, ...]

    @property
    def bytes_per_token(self) -> int:
        return sum(len(g.layer_indices) * g.bytes_per_token_per_layer for g in self.groups)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_blocks_for(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.bytes_per_block)
