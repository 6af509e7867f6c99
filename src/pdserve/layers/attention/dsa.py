"""The DeepSeek Sparse Attention (DSA) indexer (DeepSeek-V3.2, GLM-5).

Per token a small key ``k = LayerNorm(wk(x))`` (``index_head_dim`` values, one head shared
by every index head) goes to its own cache group ("indexer", same block tables as the
MLA latents). Each query token ``t`` scores every earlier key ``s`` of its request:

    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s] / sqrt(head_dim))

with ``q = wq_b(qr)`` per index head (``qr`` is MLA's q-LoRA latent) and ``w =
weights_proj(x) / sqrt(n_heads)``; both q and k carry RoPE on their first
``qk_rope_head_dim`` dimensions (interleaved for GLM-5, half-split for DeepSeek-V3.2).
The query attends to the ``index_topk`` highest-scoring keys (all of them when its
context is shorter). Scores are float32, as in the HF reference.

Output: ``topk`` [T, index_topk] int64, key positions inside the request, -1 where fewer
keys exist. Index-sharing layers (GLM-5.2) build no indexer and keep no indexer cache:
they reuse the previous full layer's ``topk``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.core_types.cache_spec import CacheLayout
from pdserve.forward_context import get_forward_context
from pdserve.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from pdserve.layers.attention.paged_gather import context_positions, gather_context, token_chunks
from pdserve.layers.linear import Linear
from pdserve.layers.norm import LayerNorm
from pdserve.layers.rotary import RopeInputs

_CHUNK_BYTES = 1 << 30


class IndexerTorchBackend(AttentionBackend):
    """Reference scoring and top-k: torch ops, no host sync, static shapes per batch shape."""

    name = "indexer_torch"
    supports_cuda_graphs = True

    def forward(
        self,
        q: torch.Tensor,  # [T, n_heads, D]
        k: torch.Tensor | None,  # [T, D]; None: already in the cache
        weights: torch.Tensor,  # [T, n_heads] float32 (already / sqrt(n_heads))
        cache: torch.Tensor,  # [blocks, block_size, D]
        md: CommonAttentionMetadata,
        topk: int,
        scale: float,
    ) -> torch.Tensor:  # [T, topk] int64
        t = md.num_actual_tokens
        if k is not None:
            flat = cache.view(-1, cache.shape[-1])
            flat.index_copy_(0, md.slot_mapping[:t], k[:t].to(cache.dtype))
        ctx, _ = gather_context(md, cache)  # [B, S, D]
        s = ctx.shape[1]
        out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
        row = s * (q.shape[1] + 2) * 4 + s * cache.shape[-1] * 4
        for a, b in token_chunks(t, row, _CHUNK_BYTES):
            keys = ctx[md.token_req_idx[a:b]].float()  # [n, S, D]
            scores = torch.einsum("nhd,nsd->nhs", q[a:b].float(), keys) * scale
            index = torch.einsum("nh,nhs->ns", weights[a:b], F.relu(scores))
            pos = context_positions(md, a, b)
            causal = torch.arange(s, device=q.device)[None, :] <= pos[:, None]
            index = index.masked_fill(~causal, float("-inf"))
            kk = min(topk, s)
            vals, idx = index.topk(kk, dim=-1)
            out[a:b, :kk] = torch.where(vals > float("-inf"), idx, -1)
        return out


class Indexer(nn.Module):
    """The lightning indexer of one layer (HF names: ``wq_b``, ``wk``, ``k_norm``,
    ``weights_proj``) and the owner of that layer's indexer-key cache."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        rope_dim: int,
        topk: int,
        rope_interleaved: bool,
        dtype: torch.dtype,
        cache_group: str = "indexer",
    ) -> None:
        super().__init__()
        if rope_dim > head_dim:
            raise ValueError(f"qk_rope_head_dim {rope_dim} exceeds index_head_dim {head_dim}")
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.rope_dim = rope_dim
        self.topk = topk
        self.rope_interleaved = rope_interleaved
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim, dtype=dtype)
        self.wk = Linear(hidden_size, head_dim, dtype=dtype)
        self.k_norm = LayerNorm(head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = Linear(hidden_size, n_heads, dtype=dtype)
        self.cache_group = cache_group
        self.layer_name = ""

    def kv_cache_layout(self, block_size: int, dtype: str) -> CacheLayout:
        return CacheLayout("indexer", dtype, (1, block_size, self.head_dim), block_axis=0)

    def make_backend(self, choice: str, device: torch.device, max_model_len: int) -> Any:
        """``triton`` (``auto`` on CUDA): :class:`IndexerTritonBackend`; else the reference."""
        if choice == "triton" or (choice == "auto" and device.type == "cuda"):
            from pdserve.layers.attention.dsa_triton import IndexerTritonBackend

            return IndexerTritonBackend()
        return IndexerTorchBackend()

    def forward(self, x: torch.Tensor, qr: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        """Top-k key positions [T, index_topk] for the tokens ``x`` (with MLA's ``qr``)."""
        t = x.shape[0]
        r = self.rope_dim
        q = self.wq_b(qr).view(t, self.n_heads, self.head_dim)
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.layer_name]
        md = ctx.attn_metadata[self.cache_group]
        k: torch.Tensor | None
        if rope.fused:  # one kernel: q's RoPE, the weights' scale, k's norm, RoPE and write
            from pdserve.kernels.mla_prep import indexer_prepare

            c = getattr(md, "common", md)
            rt, kn = rope.rope, self.k_norm
            q, weights = indexer_prepare(
                q, self.wk(x), self.weights_proj(x), kn.weight, kn.bias, kn.eps,
                rope.positions, rt.cos_cache[:, : r // 2], rt.sin_cache[:, : r // 2],
                self.rope_interleaved, cache, c.slot_mapping[: c.num_actual_tokens],
            )  # fmt: skip
            k = None
        else:
            k = self.k_norm(self.wk(x))
            q = torch.cat([rope.apply(q[..., :r], self.rope_interleaved), q[..., r:]], dim=-1)
            k_rot = rope.apply(k[:, None, :r], self.rope_interleaved)[:, 0]
            k = torch.cat([k_rot, k[:, r:]], dim=-1)
            weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return ctx.backends[self.cache_group].forward(
            q, k, weights, cache, md, self.topk, self.head_dim**-0.5
        )
