"""The Triton MLA backend (``--attention-backend triton``, or ``auto`` on CUDA).

Same cache layout and forward contract as :class:`~pdserve.layers.attention.mla.MLATorchBackend`
(either reads a cache the other wrote): write this step's latents and rotated keys
through the slot mapping, then one :func:`~pdserve.kernels.sparse_mla.sparse_mla_attention`
launch (plus its split combine) for every token of the step, whatever the batch shape:
sparse over each token's top-k where its request's context is longer than ``index_topk``,
dense over the causal context otherwise (and always without an indexer).

Graph safety: the launch shape comes from host ints only (tokens, heads, and the split
count from the top-k width or the static ``max_model_len``); the dense/sparse choice is
made per token on the device. Rows past ``num_actual_tokens`` (graph padding) are zeros.

An fp8 cache's scale (``kv_scale``) divides the row written and multiplies the kernel's
softmax scale and its output (the latent is the value too): no kernel argument of its own.
"""

from __future__ import annotations

import torch

from pdserve.kernels._utils import num_sms
from pdserve.kernels.reference import write_paged
from pdserve.kernels.sparse_mla import choose_splits, sparse_mla_attention
from pdserve.layers.attention.backend import AttentionBackend, CommonAttentionMetadata


class MLATritonBackend(AttentionBackend):
    name = "mla_triton"
    supports_cuda_graphs = True

    def __init__(self, max_model_len: int | None = None) -> None:
        self.max_model_len = max_model_len

    def forward(
        self,
        q_lat: torch.Tensor,  # [T, H, L]
        q_pe: torch.Tensor,  # [T, H, R]
        latent: torch.Tensor | None,  # [T, L]; None (and k_pe): already in the cache
        k_pe: torch.Tensor | None,  # [T, R]
        cache: torch.Tensor,  # [blocks, block_size, L + R]
        md: CommonAttentionMetadata,
        scale: float,
        topk: torch.Tensor | None,  # [T, K] key positions, -1 for none
        kv_scale: float = 1.0,  # an fp8 cache's scale (1.0 for any other)
    ) -> torch.Tensor:  # [T, H, L]
        t = md.num_actual_tokens
        if latent is not None and k_pe is not None:  # None: the layer's prepare wrote them
            entry = torch.cat([latent[:t], k_pe[:t]], dim=-1)
            flat = cache.view(-1, cache.shape[-1])
            write_paged(flat, md.slot_mapping[:t], entry, kv_scale)  # fp8: / kv_scale, saturated
        bound = topk.shape[1] if topk is not None else (self.max_model_len or md.max_seq_len)
        splits = choose_splits(t, q_lat.shape[1], bound, num_sms(q_lat.device), q_lat.shape[2])
        out = torch.empty_like(q_lat)
        sparse_mla_attention(
            q_lat,  # strided rows are fine (the W_UK product's [H, T, L] layout)
            q_pe.contiguous(),
            cache,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            md.token_req_idx,
            md.token_q_idx,
            topk,
            scale * kv_scale,
            t,
            splits,
            out,
        )
        if kv_scale != 1.0:
            out[:t].mul_(kv_scale)
        if q_lat.shape[0] > t:
            out[t:].zero_()
        return out
