"""Attention backend interface.

A backend serves one cache group (the layers that declared the same cache layout,
see :mod:`pdserve.core_types.cache_spec`). It owns (1) the metadata it needs per
step, built from the runner's :class:`CommonAttentionMetadata` (one per step, shared
by every group: all groups use the same block tables), and (2) the forward its
layers call: write this step's entries through the slot mapping, then attend over
the paged cache. Everything a backend reads during the forward is a device tensor or a
host int fixed before the forward starts, so a decode forward can be captured in a
CUDA graph (:meth:`AttentionBackend.prepare_for_capture`).

Slot mapping convention: ``slot = block_id * block_size + offset``. Block 0 is the
pool's null block: padded tokens write there and nothing ever reads it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from pdserve.layers.rotary import RopeInputs


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
    """One cache group's backend: its per-step metadata and its CUDA-graph hooks. The
    layers of the group call its family-specific forward (:class:`GQABackend` for K/V
    attention; MLA and the DSA indexer bring their own)."""

    name: ClassVar[str]
    # True when a uniform decode forward can be captured in a CUDA graph: every launch
    # shape comes from host ints fixed at capture, every tensor read is a static buffer
    supports_cuda_graphs: ClassVar[bool] = False

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Turn the common metadata into this backend's own (default: use it as is)."""
        return common

    def graph_context_widths(self, max_model_len: int) -> list[int]:
        """Context widths (a step's ``max_seq_len``) below ``max_model_len`` to capture
        decode graphs at as well: a backend whose captured work grows with the width it
        was captured at asks for narrower graphs, which steps whose longest context
        fits replay instead (default: none)."""
        return []

    def prepare_for_capture(  # noqa: B027 (an optional hook with a no-op default)
        self,
        max_batch: int,
        query_len: int,
        layers: Sequence[nn.Module],
        device: torch.device,
        max_model_len: int,
    ) -> None:
        """Allocate whatever workspaces graphs of up to ``max_batch`` requests of
        ``query_len`` tokens will capture, for the group's ``layers`` (default: none)."""


class GQABackend(AttentionBackend):
    """Paged attention over K and V per KV head (Llama, Qwen3).

    ``k_scale`` / ``v_scale``: an fp8 cache's static per-layer scales (it stores
    ``k / k_scale``, attention reads ``stored * k_scale``); 1.0 for any other cache.
    Every read path applies each exactly once; one that attends over this step's
    unquantized K/V instead of the cache applies neither.

    ``rope``: q and k come unrotated; the backend rotates them (in place where the
    fused kernels are on, :meth:`RopeInputs.rotate`) before it writes and attends, and
    may fuse the rotation with its cache write (one launch)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, blocks, block_size, num_kv_heads, head_dim]
        metadata: Any,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rope: RopeInputs | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
