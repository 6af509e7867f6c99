"""Multi-head latent attention (DeepSeek-V2, 2024) over a paged latent cache.

The cache holds, per token, the normalised KV latent ``c`` (``kv_lora_rank`` values) and
the rotated shared key part ``k_pe`` (``qk_rope_head_dim``): one ``[blocks, block_size,
kv_lora_rank + qk_rope_head_dim]`` tensor per layer (group "mla"), 576 values a token for
GLM-5 against 2 x 64 x 256 for expanded K and V.

Attention runs in the absorbed form: with ``kv_b_proj.weight`` viewed as ``[H, nope + v,
kv_lora_rank]``, ``W_UK`` its first ``nope`` rows and ``W_UV`` the rest,

    score(t, s) = (q_nope[t] W_UK) . c[s] + q_pe[t] . k_pe[s]      (times the scale)
    out[t]      = W_UV (sum_s softmax(score)[t, s] c[s])

which is the expanded attention of the paper, computed without materialising per-head
K and V. With DSA, each query attends only to the key positions its indexer selected
(``topk`` [T, K], positions inside the request, -1 for none); without, to its whole
causal context.

An fp8 latent cache has one static scale per layer (``kv_scale``, the layer's
``k_scale``): the row stored is ``[c, k_pe] / kv_scale``; reading multiplies the softmax
scale and the output by it, since the latent is both key and value.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.core_types.cache_spec import CacheLayout
from pdserve.forward_context import get_forward_context
from pdserve.kernels.reference import write_paged
from pdserve.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from pdserve.layers.attention.kv_scale import FP8CacheScales
from pdserve.layers.attention.paged_gather import (
    context_positions,
    gather_context,
    positions_to_slots,
    token_chunks,
)
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import RopeInputs

_CHUNK_BYTES = 1 << 30  # working memory one chunk of queries may take


class MLATorchBackend(AttentionBackend):
    """The reference MLA backend: torch ops, no host sync (chunk boundaries are host ints),
    static shapes for a given batch shape, so uniform decode batches capture in graphs.
    An fp8 cache is dequantized as it is read (``stored * kv_scale``)."""

    name = "mla_torch"
    supports_cuda_graphs = True

    def forward(
        self,
        q_lat: torch.Tensor,  # [T, H, L]: q_nope absorbed through W_UK
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
        lat_dim = q_lat.shape[-1]
        flat = cache.view(-1, cache.shape[-1])
        if latent is not None and k_pe is not None:  # None: the caller wrote them
            entry = torch.cat([latent[:t], k_pe[:t]], dim=-1)
            write_paged(flat, md.slot_mapping[:t], entry, kv_scale)  # fp8: / kv_scale, saturated
        out = q_lat.new_zeros(q_lat.shape)
        q = torch.cat([q_lat, q_pe], dim=-1)
        if topk is not None:
            row = topk.shape[1] * cache.shape[-1] * (cache.element_size() + 4)
            for a, b in token_chunks(t, row, _CHUNK_BYTES):
                req = md.token_req_idx[a:b]
                keys = flat[positions_to_slots(md, req, topk[a:b])]  # [n, K, L+R]
                valid = topk[a:b] >= 0
                out[a:b] = _attend(q[a:b], keys, valid, lat_dim, scale, kv_scale)
        else:
            ctx, ctx_len = gather_context(md, cache)  # [B, S, L+R]
            row = ctx.shape[1] * cache.shape[-1] * (cache.element_size() + 4)
            for a, b in token_chunks(t, row, _CHUNK_BYTES):
                req = md.token_req_idx[a:b]
                pos = context_positions(md, a, b)
                valid = torch.arange(ctx.shape[1], device=q.device)[None, :] <= pos[:, None]
                out[a:b] = _attend(q[a:b], ctx[req], valid, lat_dim, scale, kv_scale)
        return out


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    lat_dim: int,
    scale: float,
    kv_scale: float,
) -> torch.Tensor:
    """q [n, H, L+R] over keys [n, S, L+R] (as stored: times ``kv_scale`` is their value)
    where ``valid`` [n, S]; values are the latent part of the keys. Softmax in float32."""
    keys = keys.float() * kv_scale if kv_scale != 1.0 else keys.float()
    scores = torch.einsum("nhd,nsd->nhs", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = scores.softmax(dim=-1).nan_to_num(0.0)  # a row with no key outputs zeros
    return torch.einsum("nhs,nsl->nhl", p, keys[..., :lat_dim]).to(q.dtype)


class MLAAttention(FP8CacheScales, nn.Module):
    """The cache-owning part of an MLA layer: writes this step's latents and attends.

    The model computes the projections; this takes q (nope and rotated parts per head),
    the normalised latent and the rotated shared key, and ``kv_b_proj``'s weight, and
    returns ``[T, H * v_head_dim]`` (before ``o_proj``). The latent cache may be
    float8_e4m3fn (``--kv-cache-dtype fp8``) with one static scale for the whole row
    (:class:`~pdserve.layers.attention.kv_scale.FP8CacheScales`, 1.0 unless the checkpoint
    gives one).
    """

    single_kv_scale = True

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        cache_group: str = "mla",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        self.cache_group = cache_group
        self.layer_name = ""

    def kv_cache_layout(self, block_size: int, dtype: str) -> CacheLayout:
        width = self.kv_lora_rank + self.qk_rope_head_dim
        return CacheLayout("mla", dtype, (1, block_size, width), block_axis=0)

    def make_backend(self, choice: str, device: torch.device, max_model_len: int) -> Any:
        """``triton`` (``auto`` on CUDA): :class:`MLATritonBackend`; else the reference."""
        if choice == "triton" or (choice == "auto" and device.type == "cuda"):
            from pdserve.layers.attention.mla_triton import MLATritonBackend

            return MLATritonBackend(max_model_len)
        return MLATorchBackend()

    def prepare(
        self,
        q_pe: torch.Tensor,  # [T, H, R], not rotated (a view of q_b_proj's output)
        kv: torch.Tensor,  # [T, L + R]: kv_a_proj_with_mqa's output
        norm: RMSNorm,  # kv_a_layernorm
        rope: RopeInputs,
        interleaved: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(rotated ``q_pe``, normalised latent, rotated ``k_pe``) of this step's tokens.
        Where the fused kernels are on (``rope.fused``) one kernel does it all and also
        writes this step's cache rows: then the latent and ``k_pe`` come back None, and
        :meth:`forward` takes them so (nothing left to write)."""
        if rope.fused:
            from pdserve.kernels.mla_prep import mla_prepare

            ctx = get_forward_context()
            cache = ctx.kv_caches[self.layer_name]
            md = ctx.attn_metadata[self.cache_group]
            md = getattr(md, "common", md)
            r = rope.rope
            q_pe = mla_prepare(
                q_pe, kv, norm.weight, norm.eps, rope.positions, r.cos_cache, r.sin_cache,
                interleaved, cache, md.slot_mapping[: md.num_actual_tokens],
                self.cache_scales(cache)[0],
            )  # fmt: skip
            return q_pe, None, None
        latent, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe = rope.apply(q_pe, interleaved)
        return q_pe, norm(latent), rope.apply(k_pe.unsqueeze(1), interleaved)[:, 0]

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_pe: torch.Tensor,  # [T, H, R], rotated
        latent: torch.Tensor | None,  # [T, L], normalised; None: written by prepare()
        k_pe: torch.Tensor | None,  # [T, R], rotated
        kv_b_weight: torch.Tensor,  # [H * (nope + v), L]
        topk: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx = get_forward_context()
        w = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]
        # [T, H, L] as a view of the [H, T, L] product (the backends take strided rows)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        cache = ctx.kv_caches[self.layer_name]
        out_lat = ctx.backends[self.cache_group].forward(
            q_lat,
            q_pe,
            latent,
            k_pe,
            cache,
            ctx.attn_metadata[self.cache_group],
            self.scale,
            topk,
            self.cache_scales(cache)[0],
        )
        # W_UV per head, written straight into [T, H, V] rows (no copy before o_proj)
        t = out_lat.shape[0]
        out = torch.empty(t, self.num_heads, self.v_head_dim, dtype=out_lat.dtype,
                          device=out_lat.device)  # fmt: skip
        torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out.view(t, self.num_heads * self.v_head_dim)
