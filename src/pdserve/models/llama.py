"""Llama (Touvron et al., 2023; Llama 3, 2024) and Qwen3, one decoder on shared layers.

    h   = embed(tokens)
    for each layer:
        h = h + o_proj(attention(rope(q), rope(k), v))      q, k, v = qkv_proj(rmsnorm(h))
        h = h + down_proj(silu(gate) * up)                  gate, up = gate_up_proj(rmsnorm(h))
    out = rmsnorm(h)

Grouped-query attention (``num_key_value_heads`` ≤ ``num_attention_heads``),
half-rotation RoPE with optional llama3 frequency scaling, SwiGLU MLP, tied or
untied LM head. Qwen3 is the same network plus an RMSNorm over each head of q and
k before RoPE (``q_norm``/``k_norm``).

The residual add is fused into the next RMSNorm (``norm(x, residual)``), which is
the same arithmetic as the textbook form above. Inputs are flat: T tokens of any
number of requests back to back; attention reads the batch layout and the KV
cache from the forward context. Tensor names follow the HF checkpoint; q/k/v and
gate/up are stored merged (one GEMM each) and loaded from HF's separate tensors.

Tensor parallelism (``groups.tp`` of size n): each rank holds n-th of the query heads
and of the KV heads (q|k|v column-parallel, each part split on its own; its KV cache
holds its own KV heads), ``o_proj`` is row-parallel, gate|up column-parallel and
``down_proj`` row-parallel (one all-reduce after attention, one after the MLP), and the
embedding and LM head are split by vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pdserve.distributed.groups import Group, ParallelGroups
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.attention import Attention
from pdserve.layers.embedding import LMHead, VocabEmbedding
from pdserve.layers.linear import (
    checkpoint_targets,
    copy_checked,
    enable_skinny,
    norm_then_linear,
    silu_then_linear,
)
from pdserve.layers.norm import RMSNorm
from pdserve.layers.parallel_linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    tp_divide,
)
from pdserve.layers.rotary import RopeInputs, RotaryEmbedding
from pdserve.models.hf_config import HFModelConfig
from pdserve.models.kv_scales import load_kv_scale
from pdserve.models.registry import CausalLM

# Tensors some HF checkpoints carry that are derived, not learned.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, config: HFModelConfig, dtype: torch.dtype, qk_norm: bool, tp: Group) -> None:
        super().__init__()
        # this rank's heads
        self.num_heads = tp_divide(config.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads = tp_divide(config.num_key_value_heads, tp, "num_key_value_heads")
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        n = tp.size
        self.qkv_proj = MergedColumnParallelLinear(
            config.hidden_size,
            {"q_proj": n * self.q_size, "k_proj": n * self.kv_size, "v_proj": n * self.kv_size},
            bias=config.attention_bias,
            dtype=dtype,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(
            n * self.q_size, config.hidden_size, bias=config.attention_bias, dtype=dtype, tp=tp
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, qkv: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        """From the q|k|v projection's output (the layer takes it with its norm)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE is applied with the cache write (one launch where the kernels are on)
        out = self.attn(q.flatten(1), k.flatten(1), v, rope)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: HFModelConfig, dtype: torch.dtype, tp: Group) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"{config.path}: hidden_act {config.hidden_act!r} is not supported (only 'silu')"
            )
        inter = config.intermediate_size
        what = "intermediate_size"
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            {"gate_proj": inter, "up_proj": inter},
            bias=config.mlp_bias,
            dtype=dtype,
            tp=tp,
            what={"gate_proj": what, "up_proj": what},
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias=config.mlp_bias, dtype=dtype, tp=tp, what=what
        )

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """From the gate|up projection's output (the layer takes it with its norm)."""
        return silu_then_linear(self.act_fn, self.down_proj, gate_up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, dtype: torch.dtype, qk_norm: bool, tp: Group) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(config, dtype, qk_norm, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = LlamaMLP(config, dtype, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it is added)."""
        # the first layer has no residual: the residual stream is the embedding
        attn = self.self_attn
        qkv, residual = norm_then_linear(self.input_layernorm, attn.qkv_proj, hidden, residual)
        hidden = attn(qkv, rope)
        gate_up, residual = norm_then_linear(
            self.post_attention_layernorm, self.mlp.gate_up_proj, hidden, residual
        )
        return self.mlp(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, config: HFModelConfig, dtype: torch.dtype, qk_norm: bool, tp: Group) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, qk_norm, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb.prepare(positions)  # once per forward, shared by all layers
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    """Llama 2/3 (and Qwen3 through :class:`Qwen3ForCausalLM`)."""

    qk_norm = False
    # decode batches up to this many rows run the decode-size GEMM (one row: SiLU-and-mul
    # folded into down's launch) and launch dependently: llama-8b-shape on the H100 at
    # batch 1 x 1K, 5.94 ms a step against 6.13 with cuBLAS and no PDL, 16 rows even
    # (RESULTS.md runs 120-121). From 17 rows cuBLAS and no PDL: dependent launches cost
    # 1.4-1.7% at 64 rows (runs 84, 90-93, 120), where cuBLAS GEMMs do not launch their
    # successors early; FP8 linears take it at one row only (enable_skinny).
    # PDSERVE_SKINNY_ROWS / PDSERVE_PDL override.
    skinny_rows = 16
    pdl_tokens: int | None = 0  # configure_decode: the rows the decode-size GEMM takes

    def __init__(
        self,
        config: HFModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        groups: ParallelGroups | None = None,
    ) -> None:
        super().__init__(config, dtype)
        self.groups = groups if groups is not None else ParallelGroups()  # DP: a replica
        if config.raw.get("use_sliding_window"):
            raise ValueError(f"{config.path}: sliding-window attention is not supported")
        tp = self.groups.tp
        self.model = LlamaModel(config, dtype, self.qk_norm, tp)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype, tied=tied, tp=tp)

    def configure_decode(self) -> None:
        self.pdl_tokens = enable_skinny(self, self.skinny_rows)  # PDL where it runs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_tensor_names(self) -> set[str]:
        return set(checkpoint_targets(self))

    def fp8_activation_links(self) -> list[tuple[str, list[str]]]:
        links = []
        for i in range(len(self.model.layers)):
            p = f"model.layers.{i}."
            links += [
                (p + "input_layernorm", [p + "self_attn.qkv_proj"]),
                (p + "post_attention_layernorm", [p + "mlp.gate_up_proj"]),
                (p + "mlp.act_fn", [p + "mlp.down_proj"]),
            ]
        return links

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        targets = checkpoint_targets(self)
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store the shared matrix twice
            if load_kv_scale(self, name, tensor):  # an FP8 KV cache scale
                loaded.add(name)
                continue
            target = targets.get(name)
            if target is None:
                raise ValueError(
                    f"unexpected tensor {name!r}: {type(self).__name__} has no such weight"
                )
            copy_checked(target, tensor, name)
            loaded.add(name)
        return loaded


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense: Llama with per-head RMSNorm on q and k."""

    qk_norm = True
