"""Reference attention backend in plain PyTorch (CPU and GPU).

Vectorised over the batch: queries are gathered into a [B, max_q, H, D] block,
each request's K/V are gathered from its block table into [B, max_seq, Hkv, D],
and one masked SDPA call does the work. No host syncs: every size it needs is a
host int in the metadata. It is the numerical reference every fast backend is
tested against, not a fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.reference import write_kv_reference
from pdserve.layers.attention.backend import CommonAttentionMetadata, GQABackend
from pdserve.layers.rotary import RopeInputs


def paged_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    md: CommonAttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of the flat queries ``q`` [T, H, D] over the paged cache (an fp8
    cache is dequantized: ``stored * k_scale``, ``stored * v_scale``)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[-2]
    block_size = md.block_size
    b, max_q, max_s = md.num_reqs, md.max_query_len, md.max_seq_len
    dev = q.device
    qsl = md.query_start_loc[: b + 1].to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    ar_q = torch.arange(max_q, device=dev)
    tok = (qsl[:-1, None] + ar_q[None, :]).clamp(max=max(q.shape[0] - 1, 0))
    qp = q[tok]  # [B, max_q, H, D]

    nblk = (max_s + block_size - 1) // block_size
    bt = md.block_tables[:b, :nblk].to(torch.int64)
    kp = kv_cache[0][bt].reshape(b, nblk * block_size, num_kv_heads, head_dim)[:, :max_s]
    vp = kv_cache[1][bt].reshape(b, nblk * block_size, num_kv_heads, head_dim)[:, :max_s]
    kp, vp = kp.to(q.dtype), vp.to(q.dtype)  # an fp8 cache is read dequantized
    if k_scale != 1.0:
        kp = kp * k_scale
    if v_scale != 1.0:
        vp = vp * v_scale

    seq_lens = md.seq_lens[:b].to(torch.int64)
    q_pos = (seq_lens - q_lens)[:, None] + ar_q[None, :]  # [B, max_q]
    k_pos = torch.arange(max_s, device=dev)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, max_q, max_s]

    group = num_heads // num_kv_heads
    qh = qp.transpose(1, 2)  # [B, H, max_q, D]
    kh = kp.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = vp.transpose(1, 2).repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None], scale=scale)
    out = out.transpose(1, 2)  # [B, max_q, H, D]
    t = md.num_actual_tokens
    return out[md.token_req_idx[:t], md.token_q_idx[:t]]


class TorchReferenceBackend(GQABackend):
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CommonAttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rope: RopeInputs | None = None,
    ) -> torch.Tensor:
        t = metadata.num_actual_tokens
        if rope is not None:
            q, k = rope.rotate(q, k)
        write_kv_reference(k[:t], v[:t], kv_cache, metadata.slot_mapping[:t], k_scale, v_scale)
        out = paged_attention_reference(q[:t], kv_cache, metadata, scale, k_scale, v_scale)
        if q.shape[0] > t:  # padded tokens (graph padding) get zeros
            out = torch.cat([out, out.new_zeros(q.shape[0] - t, *out.shape[1:])])
        return out
