"""The matrix FLOPs one prompt's prefill does in the DeepSeek / GLM-5 family, by the kernel
categories of :mod:`pdserve.profiling.step_profile`: the compute side of the prefill section
of ``benchmarks/glm5_bench.py`` (achieved TFLOP/s of a category = its FLOPs over its
profiled device time).

One request of ``n`` prompt tokens, no cached prefix, positions ``0 .. n-1``; a matrix
product of ``m x k`` by ``k x n`` counts ``2 m k n``. Per target layer (MTP layers do not
run in a plain prefill):

- **mla_attention** (the sparse MLA kernel alone): a query row at position ``p`` reads
  ``keys(p)`` latent rows: ``min(p + 1, index_topk)`` with an indexer, ``p + 1`` without;
  each costs ``2 * heads * (kv_lora_rank + rope)`` for the scores and
  ``2 * heads * kv_lora_rank`` for the values.
- **indexer_score** (layers that run their own indexer, and only when ``n >
  index_topk``: a shorter prompt selects every key and is not scored): each row scores
  every causal key, ``n (n + 1) / 2`` pairs, ``2 * index_heads * index_head_dim`` each.
- **moe_experts**: ``2 * n * experts_per_token * 3 * hidden * moe_intermediate``.
- **router**: ``2 * n * hidden * n_routed_experts`` per MoE layer.
- **dense_gemm**: ``2 * n * (in * out)`` of every other linear layer of the target
  (attention and indexer projections, dense MLPs, shared experts), the LM head for the
  last token only, and the absorbed ``kv_b_proj`` of every token: ``q_nope`` through
  ``W_UK`` (``2 * heads * nope * kv_lora_rank``) and the latent output through ``W_UV``
  (``2 * heads * kv_lora_rank * v_head_dim``). Those two run as batched cuBLAS GEMMs,
  which the profiler files under dense GEMMs, so their FLOPs are counted there too (until
  2026-12-05 they were counted under attention while their time was not: the attention
  share read about 10% high).

Top-k selection, norms and RoPE do no matrix work and have no FLOP count here.

A decode or verify step (:meth:`PrefillFlopModel.step_flops`): ``B`` requests of ``r``
query rows each (``1 + k`` in a speculative verify), request ``b``'s rows at the last
``r`` positions of its context of ``n_b`` keys. The same formulas per row: a row reads
``min(pos + 1, index_topk)`` latent rows and scores ``pos + 1`` keys (when the context
is longer than ``index_topk``); every row passes through the experts, the other linear
layers and the LM head (each row is sampled). With the byte model of
:mod:`pdserve.profiling.decode_roofline` it gives a step's roofline that holds when the
rows are many: per part, the larger of its bytes over the bandwidth and its FLOPs over the
matmul rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.profiling.decode_roofline import layer_index


def mla_pair_flops(heads: int, latent: int, rope: int) -> int:
    """Matrix FLOPs of the sparse MLA kernel per (query row, latent row) pair: the scores
    over the latent and RoPE parts, then the values over the latent."""
    return 2 * heads * (latent + rope) + 2 * heads * latent


@dataclass(frozen=True)
class PrefillFlopModel:
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_head_dim: int
    index_topk: int | None
    attention_layers: int
    indexer_layers: int  # layers that run their own indexer
    index_heads: int
    index_head_dim: int
    moe_layers: int
    experts_per_token: int
    num_experts: int
    hidden: int
    moe_intermediate: int
    dense_weights: int  # in * out summed over the other linear layers of the target
    lm_head: int  # vocabulary x hidden

    @classmethod
    def from_model(cls, model: Any) -> PrefillFlopModel:
        """The FLOP model of ``model`` (a DeepSeek / GLM-5 family ``CausalLM``, any
        device); head counts are this rank's (tensor parallelism splits them)."""
        from pdserve.layers.attention.dsa import Indexer
        from pdserve.layers.linear import Linear
        from pdserve.layers.moe import RoutedExperts

        hc, dc = model.config, model.dc
        n = int(hc.num_hidden_layers)
        attn = [m for name, m in model.named_modules() if name.endswith("self_attn")
                and (layer_index(name) or 0) < n]  # fmt: skip
        dense = moe_layers = indexers = 0
        for name, mod in model.named_modules():
            i = layer_index(name)
            if i is not None and i >= n:
                continue  # the MTP layers
            if isinstance(mod, RoutedExperts):
                moe_layers += 1
            elif isinstance(mod, Indexer):
                indexers += 1
            elif isinstance(mod, Linear) and not name.endswith("kv_b_proj"):
                dense += mod.in_features * mod.out_features
        heads = int(attn[0].num_heads) if attn else 0
        return cls(
            num_heads=heads,
            kv_lora_rank=int(dc.kv_lora_rank),
            rope_dim=int(dc.qk_rope_head_dim),
            nope_dim=int(dc.qk_nope_head_dim),
            v_head_dim=int(dc.v_head_dim),
            index_topk=dc.index_topk,
            attention_layers=len(attn),
            indexer_layers=indexers,
            index_heads=int(dc.index_n_heads),
            index_head_dim=int(dc.index_head_dim),
            moe_layers=moe_layers,
            experts_per_token=int(dc.num_experts_per_tok),
            num_experts=int(dc.n_routed_experts),
            hidden=int(hc.hidden_size),
            moe_intermediate=int(dc.moe_intermediate_size),
            dense_weights=dense,
            lm_head=int(hc.vocab_size) * int(hc.hidden_size),
        )

    def attended_pairs(self, n: int) -> int:
        """(query row, latent row) pairs of attention over a prompt of ``n`` tokens."""
        k = self.index_topk
        if k is None or n <= k:
            return n * (n + 1) // 2
        return k * (k + 1) // 2 + (n - k) * k  # rows 0..k-1 read p + 1, the rest k

    def flops(self, n: int) -> dict[str, float]:
        """FLOPs of a prefill of ``n`` tokens by category, and ``total``."""
        h, lat = self.num_heads, self.kv_lora_rank
        per_pair = mla_pair_flops(h, lat, self.rope_dim)
        absorbed = 2 * h * (self.nope_dim * lat + lat * self.v_head_dim)
        scored = n * (n + 1) // 2 if self.index_topk is not None and n > self.index_topk else 0
        out = {
            "mla_attention": float(self.attention_layers * self.attended_pairs(n) * per_pair),
            "indexer_score": float(
                self.indexer_layers * scored * 2 * self.index_heads * self.index_head_dim
            ),
            "moe_experts": float(self.moe_layers * 2 * n * self.experts_per_token * 3
                                 * self.hidden * self.moe_intermediate),  # fmt: skip
            "router": float(self.moe_layers * 2 * n * self.hidden * self.num_experts),
            "dense_gemm": float(2 * n * self.dense_weights + 2 * self.lm_head
                                + self.attention_layers * n * absorbed),  # fmt: skip
        }
        out["total"] = sum(out.values())
        return out

    def step_flops(self, seq_lens: Sequence[float], rows_per_request: int = 1) -> dict[str, float]:
        """FLOPs of a decode / verify step by category, and ``total`` (module docstring):
        ``seq_lens`` each request's context including this step's rows (a mean over steps
        may be fractional), ``rows_per_request`` its query rows."""
        h, lat, r = self.num_heads, self.kv_lora_rank, rows_per_request
        per_pair = mla_pair_flops(h, lat, self.rope_dim)
        absorbed = 2 * h * (self.nope_dim * lat + lat * self.v_head_dim)
        k = self.index_topk
        pairs = scored = 0.0
        for n in seq_lens:
            for i in range(r):  # the rows at positions n - r .. n - 1 see n - r + 1 + i keys
                keys = max(1.0, n - r + 1 + i)
                pairs += keys if k is None else min(keys, k)
                scored += keys if k is not None and n > k else 0.0
        rows = len(seq_lens) * r
        out = {
            "mla_attention": float(self.attention_layers * pairs * per_pair),
            "indexer_score": float(
                self.indexer_layers * scored * 2 * self.index_heads * self.index_head_dim
            ),
            "moe_experts": float(self.moe_layers * 2 * rows * self.experts_per_token * 3
                                 * self.hidden * self.moe_intermediate),  # fmt: skip
            "router": float(self.moe_layers * 2 * rows * self.hidden * self.num_experts),
            "dense_gemm": float(2 * rows * (self.dense_weights + self.lm_head)
                                + self.attention_layers * rows * absorbed),  # fmt: skip
        }
        out["total"] = sum(out.values())
        return out
