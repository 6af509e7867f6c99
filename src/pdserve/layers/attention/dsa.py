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

With ``--kv-cache-dtype fp8`` the key cache holds float8_e4m3fn keys with one float32
scale a key, quantized as each key is written (the layout:
:mod:`pdserve.kernels.index_cache`), and the queries are quantized too, one scale a
(token, head) folded into the head weights (``quantize_index_queries``), as DeepSeek-V3.2
scores: the score kernels then run FP8 MMAs (over fp8 keys with model-dtype queries they
were 0.6-0.9x as fast as over bf16 keys; with fp8 queries 1.0-1.8x, RESULTS.md run 44).

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
from pdserve.kernels.index_cache import (
    fp8_index_row_bytes,
    indexer_cache_views,
    quantize_index_queries,
    write_index_keys,
)
from pdserve.kernels.reference import FP8_DTYPE
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
        cache: torch.Tensor,  # [blocks, block_size, D]; fp8: [blocks, block_size * (D + 4)]
        md: CommonAttentionMetadata,
        topk: int,
        scale: float,
    ) -> torch.Tensor:  # [T, topk] int64
        t, d = md.num_actual_tokens, q.shape[-1]
        keys, k_scale = indexer_cache_views(cache, d)
        if k is not None:
            write_index_keys(keys, k_scale, md.slot_mapping[:t], k[:t])
        if k_scale is None:
            ctx, _ = gather_context(md, keys)  # [B, S, D]
        else:  # fp8 keys times their scales (gathered as bytes: CPU torch, fp8 indexing)
            ctx = gather_context(md, keys.view(torch.uint8))[0].view(FP8_DTYPE).float()
            ctx = ctx * gather_context(md, k_scale[..., None])[0]
            q, weights = quantize_index_queries(q, weights)  # fp8 queries, scales in w
        s = ctx.shape[1]
        out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
        row = s * (q.shape[1] + 2) * 4 + s * d * 4
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
        own_wk: bool = True,
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
        # own_wk=False: the caller computes x @ wk^T (merged with its own projections of
        # x: GLM-5's fused_qkv_a_proj, which then holds the checkpoint's ``wk``)
        self.wk = Linear(hidden_size, head_dim, dtype=dtype) if own_wk else None
        self.k_norm = LayerNorm(head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = Linear(hidden_size, n_heads, dtype=dtype)
        self.cache_group = cache_group
        self.layer_name = ""

    # --kv-cache-dtype fp8: fp8 keys with a per-key scale (dynamic, no checkpoint scales)
    supports_fp8_cache = True

    def kv_cache_layout(self, block_size: int, dtype: str) -> CacheLayout:
        """[blocks, block_size, D] keys in the model dtype; for ``float8_e4m3fn`` one uint8
        row a block: ``block_size`` fp8 keys then their float32 scales (D + 4 bytes a key;
        `pdserve.kernels.index_cache.indexer_cache_views`)."""
        if dtype == str(FP8_DTYPE).removeprefix("torch."):
            row = block_size * fp8_index_row_bytes(self.head_dim)
            return CacheLayout("indexer", "uint8", (1, row), block_axis=0)
        return CacheLayout("indexer", dtype, (1, block_size, self.head_dim), block_axis=0)

    def make_backend(self, choice: str, device: torch.device, max_model_len: int) -> Any:
        """``triton`` (``auto`` on CUDA): :class:`IndexerTritonBackend`; else the reference."""
        if choice == "triton" or (choice == "auto" and device.type == "cuda"):
            from pdserve.layers.attention.dsa_triton import IndexerTritonBackend

            return IndexerTritonBackend()
        return IndexerTorchBackend()

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        rope: RopeInputs,
        k_proj: torch.Tensor | None = None,  # [T, D] x @ wk^T, where the caller computed it
    ) -> torch.Tensor:
        """Top-k key positions [T, index_topk] for the tokens ``x`` (with MLA's ``qr``)."""
        t = x.shape[0]
        if k_proj is None:
            if self.wk is None:
                raise ValueError("this indexer's wk is merged into its caller's projection")
            k_proj = self.wk(x)
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
            keys, k_scale = indexer_cache_views(cache, self.head_dim)
            q, weights = indexer_prepare(
                q, k_proj, self.weights_proj(x), kn.weight, kn.bias, kn.eps,
                rope.positions, rt.cos_cache[:, : r // 2], rt.sin_cache[:, : r // 2],
                self.rope_interleaved, keys, c.slot_mapping[: c.num_actual_tokens], k_scale,
            )  # fmt: skip
            k = None
        else:
            k = self.k_norm(k_proj)
            q = torch.cat([rope.apply(q[..., :r], self.rope_interleaved), q[..., r:]], dim=-1)
            k_rot = rope.apply(k[:, None, :r], self.rope_interleaved)[:, 0]
            k = torch.cat([k_rot, k[:, r:]], dim=-1)
            weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return ctx.backends[self.cache_group].forward(
            q, k, weights, cache, md, self.topk, self.head_dim**-0.5
        )
