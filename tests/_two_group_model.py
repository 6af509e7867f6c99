"""A test-only model with two KV cache groups of different dtype and layout.

``TwoGroupLlama`` is the tiny Llama plus, after every decoder layer, a
:class:`TokenCodes` layer that owns a second cache group ("codes"): four uint8 codes
of each token's hidden state per layer, in blocks laid out ``[blocks, block_size, 4]``
(block axis 0, where the K/V group has it at axis 1). Each code layer adds the mean of
its context's codes back into the hidden state, so the model's output depends on that
group's contents: a transfer or prefix-cache hit that lost them changes the tokens.
It has no weights of its own, so a tiny Llama checkpoint loads into it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.core_types.cache_spec import CacheLayout
from pdserve.forward_context import get_forward_context
from pdserve.layers.attention import AttentionBackend, CommonAttentionMetadata
from pdserve.models.llama import LlamaForCausalLM

ARCH = "TwoGroupLlamaForCausalLM"
CHANNELS = 4


class CodesBackend(AttentionBackend):
    name = "codes"
    supports_cuda_graphs = True

    def forward(
        self, codes: torch.Tensor, cache: torch.Tensor, md: CommonAttentionMetadata
    ) -> torch.Tensor:
        """Write this step's codes [T, C] uint8, return each token's causal context mean."""
        c = md.common if hasattr(md, "common") else md
        t = c.num_actual_tokens
        cache.view(-1, CHANNELS).index_copy_(0, c.slot_mapping[:t], codes[:t])
        b, bs = c.num_reqs, c.block_size
        nblk = -(-c.max_seq_len // bs)
        ctx = cache[c.block_tables[:b, :nblk].long()].reshape(b, nblk * bs, CHANNELS)
        qsl = c.query_start_loc[: b + 1].long()
        req = c.token_req_idx[:t]
        pos = (c.seq_lens[:b].long() - (qsl[1:] - qsl[:-1]))[req] + c.token_q_idx[:t]
        mask = torch.arange(nblk * bs, device=codes.device)[None, :] <= pos[:, None]
        total = (ctx[req].float() * mask[..., None]).sum(1)
        out = total / (pos[:, None] + 1).float()
        if codes.shape[0] > t:
            out = torch.cat([out, out.new_zeros(codes.shape[0] - t, CHANNELS)])
        return out


class TokenCodes(nn.Module):
    cache_group = "codes"

    def __init__(self) -> None:
        super().__init__()
        self.layer_name = ""

    def kv_cache_layout(self, block_size: int, dtype: str) -> CacheLayout:
        return CacheLayout("codes", "uint8", (1, block_size, CHANNELS), block_axis=0)

    def make_backend(self, choice: str, device: torch.device, max_model_len: int) -> CodesBackend:
        return CodesBackend()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        codes = ((h[:, :CHANNELS].float() * 64).round().clamp(-128, 127) + 128).to(torch.uint8)
        mean = ctx.backends[self.cache_group].forward(
            codes, ctx.kv_caches[self.layer_name], ctx.attn_metadata[self.cache_group]
        )
        bias = torch.zeros_like(h)
        bias[:, :CHANNELS] = ((mean - 128) / 8).to(h.dtype)
        return h + bias


class TwoGroupLlama(LlamaForCausalLM):
    def __init__(self, config, dtype: torch.dtype = torch.bfloat16, **options) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, dtype, **options)
        self.codes = nn.ModuleList(TokenCodes() for _ in self.model.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        m = self.model
        hidden = m.embed_tokens(input_ids)
        rope = m.rotary_emb.prepare(positions)
        residual: torch.Tensor | None = None
        for layer, codes in zip(m.layers, self.codes, strict=True):
            hidden, residual = layer(hidden, residual, rope)
            hidden = codes(hidden)
        hidden, _ = m.norm(hidden, residual)
        return hidden


def register(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Make the registry resolve ``ARCH`` to this module (in this process only)."""
    from pdserve.models import registry

    monkeypatch.setitem(registry._MODELS, ARCH, ("_two_group_model", "TwoGroupLlama"))
