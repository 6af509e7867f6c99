"""Attention backend interface.

A backend owns (1) the layout of one layer's KV cache tensor, (2) the metadata it
needs per step, built from the runner's :class:`CommonAttentionMetadata`, and (3)
the forward: write this step's K/V through the slot mapping, then attend over the
paged cache. Everything a backend reads during the forward is a device tensor or a
host int fixed before the forward starts, so a decode forward can be captured in a
CUDA graph (backends that support that expose capture hooks later).

Slot mapping convention: ``slot = block_id * block_size + offset``. Block 0 is the
pool's null block: padded tokens write there and nothing ever reads it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass
class CommonAttentionMetadata:
    """Per-step batch description shared by all backends (device tensors unless noted).

    Requests are laid out back to back: request ``b`` owns flat tokens
    ``query_start_loc[b] : query_start_loc[b+1]``; its ``seq_lens[b]`` counts the
    tokens in its context after this step (cached prefix + this step's tokens).
    """

    num_reqs: int  # host
    num_actual_tokens: int  # host; tokens past this are padding
    max_query_len: int  # host
    max_seq_len: int  # host
    block_size: int  # host
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    token_req_idx: torch.Tensor  # [num_tokens] int64: request index of each flat token
    token_q_idx: torch.Tensor  # [num_tokens] int64: index of each token inside its request's query


class AttentionBackend(ABC):
    name: ClassVar[str]
    # True when a uniform decode forward can be captured in a CUDA graph: every launch
    # shape comes from host ints fixed at capture, every tensor read is a static buffer
    supports_cuda_graphs: ClassVar[bool] = False

    def prepare_for_capture(  # noqa: B027 (an optional hook with a no-op default)
        self,
        max_batch: int,
        query_len: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        max_model_len: int | None = None,
    ) -> None:
        """Allocate whatever workspaces graphs will capture (default: none needed)."""

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache; the default holds K and V as [2, blocks, block, heads, dim]."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Turn the common metadata into this backend's own (default: use it as is)."""
        return common

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: Any,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


def write_kv_reference(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V into the paged cache ([2, blocks, block, heads, dim])."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    t = slot_mapping.shape[0]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k[:t])
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v[:t])
