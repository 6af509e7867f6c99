"""The bytes one decode step of the DeepSeek / GLM-5 family must read: the byte model
behind the decode roofline of ``benchmarks/glm5_bench.py`` (step time >= bytes / copy
bandwidth).

A decode step of B requests, one query row each, request b's context being ``n_b`` keys
once this step's token is written, must read:

- **weights**: every parameter of the target's layers once except the routed experts,
  then the final norm and the LM head. The MTP layers are not counted (a step without
  speculative decoding does not run them), nor the input embedding, of which only the B
  rows the step gathers are counted (a tied LM head is read whole, as the head).
- **routed experts**: in each MoE layer, the distinct experts the batch's tokens are
  routed to, each once (``w13`` and ``w2``, and their block scales under FP8). Given the
  routing taken (distinct experts per layer), exactly; otherwise the expectation under
  independent uniform routing, ``E * (1 - (1 - k/E)^B)``.
- **latents** (cache kind ``mla``): in every layer, per request, the rows its attention
  reads: ``min(n_b, index_topk)`` with an indexer (DSA attends to ``index_topk``
  selected keys; a context that short is attended whole), ``n_b`` without one.
- **indexer keys** (cache kind ``indexer``): only in the layers that run their own
  indexer (GLM-5.2's index-sharing layers reuse the previous full layer's selection and
  keep no key cache), and only for requests with ``n_b > index_topk``: a shorter context
  selects every key, so nothing needs scoring.
- any other cache kind: every layer reads the request's whole context.

Row sizes and dtypes come from the engine's cache config (``collect_cache_layers``), so
an FP8 cache counts one byte a latent value and ``D + 4`` bytes an indexer key (fp8
values and a float32 scale). Writes (one latent row and one indexer key per layer and request), activations
and the logits are left out: at decode they are well under 0.1% of the reads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder-layer index in a parameter or module path (``model.layers.{i}....``)."""
    m = _LAYER.search(name + ".")
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class DecodeByteModel:
    dense_weight_bytes: int  # read once a step: everything but routed experts and embedding
    expert_bytes: tuple[int, ...]  # per MoE layer of the target: bytes of one routed expert
    num_experts: int  # routed experts per MoE layer
    experts_per_token: int
    embed_row_bytes: int  # one row of the input embedding (0 when it is the LM head)
    index_topk: int | None  # None: no indexer, attention reads the whole context
    latent_row_bytes: tuple[int, ...]  # per layer with an "mla" cache: one key row
    index_key_bytes: tuple[int, ...]  # per layer that runs its own indexer: one key
    full_row_bytes: tuple[int, ...] = ()  # per layer of any other cache kind: one token

    @classmethod
    def from_model(cls, model: Any, cache_config: Any) -> DecodeByteModel:
        """The byte model of ``model`` (a :class:`~pdserve.models.glm_moe_dsa.
        DeepseekV3ForCausalLM`, possibly on the meta device) with the cache layout
        ``cache_config`` (:class:`~pdserve.core_types.cache_spec.KVCacheConfig`, as
        ``collect_cache_layers`` gives it for the engine's KV dtype)."""
        from pdserve.layers.moe import RoutedExperts

        hc, dc = model.config, model.dc
        n = int(hc.num_hidden_layers)

        def target(name: str) -> bool:
            i = layer_index(name)
            return i is None or i < n

        expert_params: set[str] = set()
        expert_bytes: list[int] = []
        for name, mod in model.named_modules():
            if not isinstance(mod, RoutedExperts):
                continue
            params = [(f"{name}.{p}", t) for p, t in mod.named_parameters()]
            expert_params.update(p for p, _ in params)
            if target(name):
                total = sum(t.numel() * t.element_size() for _, t in params)
                expert_bytes.append(total // mod.num_local_experts)
        dense = embed_row = 0
        tied = bool(getattr(hc, "tie_word_embeddings", False))
        for name, p in model.named_parameters():
            nbytes = p.numel() * p.element_size()
            if name in expert_params or not target(name):
                continue
            if name.endswith("embed_tokens.weight") and not tied:
                embed_row = p.shape[-1] * p.element_size()
                continue
            dense += nbytes
        latent: list[int] = []
        index: list[int] = []
        full: list[int] = []
        bs = cache_config.block_size
        for group in cache_config.groups:
            row = group.layout.bytes_per_block // bs
            rows = [row for name in group.layer_names if target(name)]
            kind = group.layout.kind
            (latent if kind == "mla" else index if kind == "indexer" else full).extend(rows)
        return cls(
            dense_weight_bytes=dense,
            expert_bytes=tuple(expert_bytes),
            num_experts=int(dc.n_routed_experts),
            experts_per_token=int(dc.num_experts_per_tok),
            embed_row_bytes=embed_row,
            index_topk=dc.index_topk,
            latent_row_bytes=tuple(latent),
            index_key_bytes=tuple(index),
            full_row_bytes=tuple(full),
        )

    def expected_active_experts(self, num_tokens: int) -> float:
        """Distinct experts ``num_tokens`` tokens reach in one layer under independent
        uniform routing (each token picks ``k`` of ``E`` distinct experts)."""
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** num_tokens)

    def step_bytes(
        self,
        seq_lens: Sequence[float],
        active_experts: Sequence[float] | None = None,
        rows_per_request: int = 1,
    ) -> dict[str, float]:
        """Bytes a decode step of ``len(seq_lens)`` requests must read, by part (and
        ``total``). ``seq_lens``: each request's context after this step's token (a mean
        over steps may be fractional). ``active_experts``: the distinct routed experts of
        each MoE layer (None: the uniform-routing expectation for the batch's tokens).
        ``rows_per_request``: query rows a request runs (``1 + k`` in a speculative verify
        step): each row attends to its own selection, so latents count once a row, while
        weights and indexer keys are read once a step and once a request."""
        b = len(seq_lens)
        layers = len(self.expert_bytes)
        if active_experts is None:
            active_experts = [self.expected_active_experts(b * rows_per_request)] * layers
        if len(active_experts) != layers:
            raise ValueError(f"active_experts has {len(active_experts)} layers, not {layers}")
        topk = self.index_topk
        attended = sum(n if topk is None else min(n, topk) for n in seq_lens)
        scored = sum(n for n in seq_lens if topk is not None and n > topk)
        parts = {
            "weights": float(self.dense_weight_bytes + b * self.embed_row_bytes),
            "experts": float(
                sum(a * e for a, e in zip(active_experts, self.expert_bytes, strict=True))
            ),
            "latents": float(sum(self.latent_row_bytes) * attended * rows_per_request),
            "index_keys": float(sum(self.index_key_bytes) * scored),
            "other_kv": float(sum(self.full_row_bytes) * sum(seq_lens)),
        }
        parts["total"] = sum(parts.values())
        return parts
