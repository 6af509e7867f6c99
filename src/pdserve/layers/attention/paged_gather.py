"""Gathers from a paged cache for the torch reference backends (MLA, the DSA indexer).

A cache tensor is ``[blocks, block_size, width]``; slot ``b * block_size + o`` is offset
``o`` of block ``b``. Everything here reads device tensors and host ints of the step's
:class:`CommonAttentionMetadata` only: no host sync, static shapes for a batch shape.
"""

from __future__ import annotations

import torch

from pdserve.layers.attention.backend import CommonAttentionMetadata


def token_chunks(num_tokens: int, bytes_per_token: int, budget: int) -> list[tuple[int, int]]:
    """Split ``range(num_tokens)`` so each chunk's working memory stays near ``budget``."""
    step = max(1, budget // max(1, bytes_per_token))
    return [(a, min(a + step, num_tokens)) for a in range(0, num_tokens, step)]


def context_positions(md: CommonAttentionMetadata, a: int, b: int) -> torch.Tensor:
    """Position of each token ``a..b`` of the step inside its request (int64)."""
    n = md.num_reqs
    qsl = md.query_start_loc[: n + 1].to(torch.int64)
    q_len = qsl[1:] - qsl[:-1]
    req = md.token_req_idx[a:b]
    return (md.seq_lens[:n].to(torch.int64) - q_len)[req] + md.token_q_idx[a:b]


def positions_to_slots(
    md: CommonAttentionMetadata, req: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Cache slots of ``positions`` [n, K] (inside request ``req[i]`` of row i); negative
    positions map to the first slot of the request's first block (callers mask them)."""
    bs = md.block_size
    pos = positions.clamp(min=0).to(torch.int64)
    blocks = md.block_tables[req.unsqueeze(1), pos // bs].to(torch.int64)
    return blocks * bs + pos % bs


def gather_context(
    md: CommonAttentionMetadata, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's context, ``[B, S, width]`` with S the step's ``max_seq_len`` rounded
    up to whole blocks, and the context lengths [B] (entries past a length are stale)."""
    n, bs = md.num_reqs, md.block_size
    nblk = -(-md.max_seq_len // bs)
    bt = md.block_tables[:n, :nblk].to(torch.int64)
    ctx = cache[bt].reshape(n, nblk * bs, cache.shape[-1])
    return ctx, md.seq_lens[:n].to(torch.int64)
