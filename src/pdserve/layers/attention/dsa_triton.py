"""The Triton DSA indexer backend (``--attention-backend triton``, or ``auto`` on CUDA).

Same cache layouts (model-dtype keys, or fp8 keys with per-key scales) and contract as
:class:`~pdserve.layers.attention.dsa.IndexerTorchBackend`: write this step's keys
through the slot mapping, then per token the ``index_topk`` best causal key positions
([T, K] int64, -1 pads). Scores go to a float32 buffer as wide as the
step's ``max_seq_len`` (``max_model_len`` under a CUDA graph), chunked over tokens to
bound it. A step with one query row per request (decode) scores with
:func:`~pdserve.kernels.dsa_indexer.indexer_logits` (a program per token); any other
(prefill chunks, verify rows: ``max_query_len > 1``, a host int, fixed in a verify graph)
with :func:`~pdserve.kernels.dsa_indexer_tiled.indexer_logits_tiled`, which reads each key
once for a tile of a request's query tokens. Up to ``SORT_FREE_MAX_WIDTH`` keys a row,
:func:`~pdserve.kernels.dsa_indexer.topk_select` picks the top-k without a sort, and
tokens whose request's context is at most ``index_topk`` are not scored (they select
every causal key; MLA attends densely there). Wider rows go to ``torch.topk`` (a
multi-block radix select, faster on few long rows) over fully written scores. The choice
is a host int (the width), so a captured graph keeps one path. No host sync.

A graph captured at ``max_model_len`` above ``SORT_FREE_MAX_WIDTH`` would score every
key up to that width and ``torch.topk`` it in every indexer layer, whatever the batch's
real contexts; so the backend asks for graphs captured at ``SORT_FREE_MAX_WIDTH`` too
(:meth:`graph_context_widths`), which steps whose longest context fits replay: the
sort-free path, with short rows not scored at all.
"""

from __future__ import annotations

import torch

from pdserve.kernels.dsa_indexer import SORT_FREE_MAX_WIDTH, indexer_logits, topk_select
from pdserve.kernels.dsa_indexer_tiled import indexer_logits_tiled
from pdserve.kernels.index_cache import (
    indexer_cache_views,
    quantize_index_queries,
    write_index_keys,
)
from pdserve.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from pdserve.layers.attention.paged_gather import token_chunks

_CHUNK_BYTES = 1 << 30  # the score buffer of one chunk of tokens


class IndexerTritonBackend(AttentionBackend):
    name = "indexer_triton"
    supports_cuda_graphs = True

    def graph_context_widths(self, max_model_len: int) -> list[int]:
        return [SORT_FREE_MAX_WIDTH] if max_model_len > SORT_FREE_MAX_WIDTH else []

    def forward(
        self,
        q: torch.Tensor,  # [T, n_heads, D]
        k: torch.Tensor | None,  # [T, D]; None: already in the cache
        weights: torch.Tensor,  # [T, n_heads] float32 (already / sqrt(n_heads))
        cache: torch.Tensor,  # [blocks, block_size, D]; fp8: [blocks, block_size * (D + 4)]
        md: CommonAttentionMetadata,
        topk: int,
        scale: float,
    ) -> torch.Tensor:  # [T, topk] int64
        t = md.num_actual_tokens
        cache, k_scale = indexer_cache_views(cache, q.shape[-1])
        if k is not None:
            write_index_keys(cache, k_scale, md.slot_mapping[:t], k[:t])
        width = -(-md.max_seq_len // md.block_size) * md.block_size
        if k_scale is not None:  # fp8 keys: fp8 queries too, their scales in the weights
            q, weights = quantize_index_queries(q, weights)
        q = q.contiguous()
        weights = weights.float().contiguous()
        sort_free = width <= SORT_FREE_MAX_WIDTH
        if sort_free:  # the select writes every slot of the real rows (-1 pads)
            out = torch.empty((q.shape[0], topk), dtype=torch.int64, device=q.device)
            out[t:].fill_(-1)  # graph padding (no launch when there is none)
        else:
            out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
        uniform = t == md.num_reqs * md.max_query_len
        for a, b in token_chunks(t, width * 4, _CHUNK_BYTES):
            req, qi = md.token_req_idx[a:b], md.token_q_idx[a:b]
            if md.max_query_len > 1:
                logits = indexer_logits_tiled(
                    q,
                    weights,
                    cache,
                    md.block_tables,
                    md.seq_lens,
                    md.query_start_loc,
                    md.num_reqs,
                    md.max_query_len,
                    a,
                    b,
                    scale,
                    width,
                    topk,
                    for_select=sort_free,
                    uniform=uniform,
                    k_scale=k_scale,
                )
            else:
                logits = indexer_logits(
                    q[a:b],
                    weights[a:b],
                    cache,
                    md.block_tables,
                    md.seq_lens,
                    md.query_start_loc,
                    req,
                    qi,
                    scale,
                    b - a,
                    width,
                    topk,
                    for_select=sort_free,
                    k_scale=k_scale,
                )
            if sort_free:
                topk_select(logits, md.seq_lens, md.query_start_loc, req, qi, topk, b - a, out[a:b])
            else:
                kk = min(topk, width)
                vals, idx = logits.topk(kk, dim=-1, sorted=False)
                out[a:b, :kk] = torch.where(vals > float("-inf"), idx, -1)
        return out
