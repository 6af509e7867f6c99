"""GLM-5 and DeepSeek-V3 / V3.2: MLA, DeepSeek Sparse Attention, MoE, and the MTP layer.

    h = embed(tokens)
    for each layer i:
        a, ik, kv = [q_a_proj | indexer.wk | kv_a_proj_with_mqa](x)   one GEMM
        qr      = rmsnorm(a)                           x = rmsnorm(h), the q-LoRA latent
        q       = q_b_proj(qr)                         per head: [nope | rope]
        c, k_pe = kv                                   c normed: the cached latent
        topk    = indexer(x, qr, ik) if layer i runs its indexer ("full"; DSA models)
                  the previous full layer's topk       ("shared", GLM-5.2 index sharing)
        h      += o_proj(MLA(q, c, k_pe | topk))       MLA: absorbed attention over the cache
        h      += moe(rmsnorm(h))  or  mlp(...)        dense for the first layers
    out = rmsnorm(h)

MTP (``num_nextn_predict_layers``; weights at layer index ``num_hidden_layers``): slot i
takes the target's post-norm hidden state h_i and the embedding of token t_{i+1}
(zeroed at position 0), runs ``eh_proj([enorm(e), hnorm(h)])`` through one full decoder
block (with its own indexer and caches), and ``shared_head.norm`` gives the hidden state
it returns and recycles; the target's LM head gives its draft logits.

One file for the family: ``GlmMoeDsaForCausalLM`` (GLM-5, GLM-5.2), ``DeepseekV32ForCausalLM``
and ``DeepseekV3ForCausalLM`` (no indexer) differ only in config (see
:mod:`pdserve.models.deepseek_config`). Tensor names are the published ones: experts
per expert in the checkpoint, stacked in memory; the router in float32.

Tensor parallelism (``groups.tp`` of size n) splits the attention heads: ``q_b_proj``
(or ``q_proj``) and ``kv_b_proj`` are column-parallel by heads, ``o_proj`` row-parallel.
What every head shares is replicated on every rank: ``q_a_proj``, ``kv_a_proj_with_mqa``
(merged with the indexer's ``wk`` into ``fused_qkv_a_proj``: they read the same input) and
their norms, the latent cache (each rank caches the full latent), and the DSA
indexer (its weights, its key cache and the top-k it picks; every rank computes the same).
The dense MLP of the first layers and the MoE are split by intermediate dimension (see
:mod:`pdserve.layers.moe`; the router is replicated), the embedding and LM head by
vocabulary. The MTP layer is built the same way (``eh_proj`` and its norms replicated).

Expert parallelism (``groups.ep`` of size > 1): every MoE layer, the MTP layer's
included, holds only its rank's contiguous slice of the routed experts; the model names
(and loads) only those, and :meth:`DeepseekV3ForCausalLM.is_foreign_tensor` tells the
loader which checkpoint tensors belong to other ranks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pdserve.distributed.groups import Group, ParallelGroups
from pdserve.kernels.reference import Fp8Activation
from pdserve.layers.attention.dsa import Indexer
from pdserve.layers.attention.mla import MLAAttention
from pdserve.layers.embedding import LMHead, VocabEmbedding
from pdserve.layers.linear import (
    Linear,
    MergedLinear,
    Shard,
    checkpoint_entries,
    copy_checked,
    enable_skinny,
)
from pdserve.layers.moe import DenseMLP, MoE
from pdserve.layers.norm import RMSNorm
from pdserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, tp_divide
from pdserve.layers.rotary import RopeInputs, RotaryEmbedding, yarn_softmax_mscale
from pdserve.models.deepseek_config import DeepseekConfig, read_deepseek_config
from pdserve.models.hf_config import HFModelConfig
from pdserve.models.kv_scales import load_kv_scale
from pdserve.models.registry import CausalLM

# the MTP layer's tensors that may come with a checkpoint and are the target's own
_MTP_SHARED = ("shared_head.head.weight", "embed_tokens.weight")
_LORA_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm (HF's default)


class MLASelfAttention(nn.Module):
    def __init__(
        self,
        hc: HFModelConfig,
        dc: DeepseekConfig,
        dtype: torch.dtype,
        full_indexer: bool,
        tp: Group,
    ) -> None:
        super().__init__()
        h, heads = hc.hidden_size, hc.num_attention_heads
        self.num_heads = tp_divide(heads, tp, "num_attention_heads")  # this rank's heads
        self.dc = dc
        bias = hc.attention_bias
        what = "num_attention_heads x head size"  # divisible once the heads are
        kv_a = dc.kv_lora_rank + dc.qk_rope_head_dim
        # the indexer's key projection joins the merged GEMM where it has no bias (its
        # checkpoint tensors have none)
        merged_wk = full_indexer and not bias and dc.index_head_dim is not None
        self.a_split: list[int] = []  # fused_qkv_a_proj's parts, in order
        if dc.q_lora_rank is not None:
            # q_a, the indexer's wk and kv_a read the same input: one GEMM (a decode step
            # launches one small kernel, not three); kv_a last, so FP8 block scales stay
            # whole 128-row blocks where q_lora_rank and index_head_dim are multiples
            parts = {"q_a_proj": dc.q_lora_rank}
            if merged_wk:
                assert dc.index_head_dim is not None
                parts["indexer.wk"] = dc.index_head_dim
            parts["kv_a_proj_with_mqa"] = kv_a
            self.fused_qkv_a_proj = MergedLinear(h, parts, bias=bias, dtype=dtype)
            self.a_split = list(parts.values())
            self.q_a_layernorm = RMSNorm(dc.q_lora_rank, _LORA_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(
                dc.q_lora_rank, heads * dc.qk_head_dim, dtype=dtype, tp=tp, what=what
            )
        else:
            self.q_proj = ColumnParallelLinear(
                h, heads * dc.qk_head_dim, dtype=dtype, tp=tp, what=what
            )
            self.kv_a_proj_with_mqa = Linear(h, kv_a, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(dc.kv_lora_rank, _LORA_EPS, dtype)
        self.kv_b_proj = ColumnParallelLinear(
            dc.kv_lora_rank,
            heads * (dc.qk_nope_head_dim + dc.v_head_dim),
            dtype=dtype,
            tp=tp,
            what=what,
        )
        self.o_proj = RowParallelLinear(
            heads * dc.v_head_dim, h, bias=bias, dtype=dtype, tp=tp, what=what
        )
        scale = dc.qk_head_dim**-0.5 * yarn_softmax_mscale(hc.rope_scaling)
        self.attn = MLAAttention(
            self.num_heads,
            dc.kv_lora_rank,
            dc.qk_nope_head_dim,
            dc.qk_rope_head_dim,
            dc.v_head_dim,
            scale,
        )
        self.indexer: Indexer | None = None
        if full_indexer:
            if dc.q_lora_rank is None or dc.index_topk is None:
                raise ValueError(f"{hc.path}: the DSA indexer needs q_lora_rank and index_topk")
            self.indexer = Indexer(
                h,
                dc.q_lora_rank,
                dc.index_n_heads,
                dc.index_head_dim,
                dc.qk_rope_head_dim,
                dc.index_topk,
                dc.indexer_rope_interleave,
                dtype,
                own_wk=not merged_wk,
            )

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeInputs,
        prev_topk: torch.Tensor | None,
        reuse_topk: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output [T, hidden], this layer's top-k or the one it reused). ``reuse_topk``:
        attend within ``prev_topk`` even though this layer has an indexer, which then
        neither scores nor writes its keys (MTP draft steps after the first, with
        ``index_share_for_mtp_iteration``)."""
        dc, t = self.dc, x.shape[0]
        index_k = None  # the indexer's key projection, where it is merged
        if dc.q_lora_rank is not None:
            a = self.fused_qkv_a_proj(x).split(self.a_split, dim=-1)  # row-strided views
            kv = a[-1]
            if len(a) == 3:
                index_k = a[1]
            qr = self.q_a_layernorm(a[0])
            q = self.q_b_proj(qr)
        else:
            qr, q, kv = x, self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q = q.view(t, self.num_heads, dc.qk_head_dim)
        q_nope, q_pe = q.split([dc.qk_nope_head_dim, dc.qk_rope_head_dim], dim=-1)
        # q_pe's RoPE, the latent's norm, k_pe's RoPE (and, where the fused kernels are
        # on, this step's latent-cache rows: then latent and k_pe are None): one launch
        q_pe, latent, k_pe = self.attn.prepare(
            q_pe, kv, self.kv_a_layernorm, rope, dc.rope_interleave
        )
        if self.indexer is not None and not reuse_topk:  # reads the norms' bf16 outputs
            topk = self.indexer(_hp(x), _hp(qr), rope, index_k)
        else:
            topk = prev_topk
        out = self.attn(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight, topk)
        return self.o_proj(out), topk


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        hc: HFModelConfig,
        dc: DeepseekConfig,
        dtype: torch.dtype,
        sparse_mlp: bool,
        full_indexer: bool,
        groups: ParallelGroups,
    ) -> None:
        super().__init__()
        eps = hc.rms_norm_eps
        self.input_layernorm = RMSNorm(hc.hidden_size, eps, dtype)
        self.self_attn = MLASelfAttention(hc, dc, dtype, full_indexer, groups.tp)
        self.post_attention_layernorm = RMSNorm(hc.hidden_size, eps, dtype)
        self.mlp: nn.Module
        if sparse_mlp:
            self.mlp = MoE(
                hc.hidden_size,
                dc.n_routed_experts,
                dc.num_experts_per_tok,
                dc.moe_intermediate_size,
                dc.n_shared_experts,
                dc.n_group,
                dc.topk_group,
                dc.norm_topk_prob,
                dc.routed_scaling_factor,
                dtype,
                groups,
            )
        else:
            self.mlp = DenseMLP(hc.hidden_size, hc.intermediate_size, dtype, groups.tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        prev_topk: torch.Tensor | None,
        reuse_topk: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(MLP output, the residual stream before it is added, the layer's top-k)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, topk = self.self_attn(hidden, rope, prev_topk, reuse_topk)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual, topk


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps, dtype)


class MTPLayer(DeepseekDecoderLayer):
    """One multi-token-prediction layer: a full MoE decoder block (always with its own
    indexer) plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``; it shares the
    target's embedding and LM head."""

    def __init__(
        self, hc: HFModelConfig, dc: DeepseekConfig, dtype: torch.dtype, groups: ParallelGroups
    ) -> None:
        super().__init__(hc, dc, dtype, True, dc.has_indexer, groups)
        h, eps = hc.hidden_size, hc.rms_norm_eps
        self.enorm = RMSNorm(h, eps, dtype)
        self.hnorm = RMSNorm(h, eps, dtype)
        self.eh_proj = Linear(2 * h, h, dtype=dtype)
        self.shared_head = SharedHead(h, eps, dtype)

    def predict(
        self,
        embeds: torch.Tensor,  # [T, H]: embeddings of the next tokens (zeroed at position 0)
        prev_hidden: torch.Tensor,  # [T, H]: post-norm hidden states to condition on
        rope: RopeInputs,
        shared_topk: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the post-norm hidden state [T, H], the top-k its indexer chose). With
        ``shared_topk`` the indexer is skipped and attention stays within that selection."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        out, residual, topk = self(x, None, rope, shared_topk, shared_topk is not None)
        return self.shared_head.norm(out + residual), topk


class DeepseekModel(nn.Module):
    def __init__(
        self,
        hc: HFModelConfig,
        dc: DeepseekConfig,
        dtype: torch.dtype,
        with_mtp: bool,
        groups: ParallelGroups,
    ) -> None:
        super().__init__()
        self.num_layers = hc.num_hidden_layers
        self.embed_tokens = VocabEmbedding(hc.vocab_size, hc.hidden_size, dtype, groups.tp)
        self.rotary_emb = RotaryEmbedding(
            dc.qk_rope_head_dim,
            hc.max_position_embeddings,
            hc.rope_theta,
            hc.rope_scaling,
            dtype,
        )
        layers: list[nn.Module] = [
            DeepseekDecoderLayer(
                hc,
                dc,
                dtype,
                sparse_mlp=dc.mlp_layer_types[i] == "sparse",
                full_indexer=dc.has_indexer and dc.indexer_types[i] == "full",
                groups=groups,
            )
            for i in range(hc.num_hidden_layers)
        ]
        if with_mtp:  # at the checkpoint's index: model.layers.{num_hidden_layers + j}
            layers += [MTPLayer(hc, dc, dtype, groups) for _ in range(dc.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hc.hidden_size, hc.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb.prepare(positions)
        residual: torch.Tensor | None = None
        topk: torch.Tensor | None = None
        for layer in self.layers[: self.num_layers]:
            hidden, residual, topk = layer(hidden, residual, rope, topk)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 (MLA + MoE); with the config's ``index_topk``, DeepSeek-V3.2 and GLM-5
    (plus DSA). ``with_mtp`` builds the MTP layers (speculative decoding uses them)."""

    has_mtp = True  # the architecture defines MTP layers (num_nextn_predict_layers of them)
    fp8_dense_modules = ("kv_b_proj",)  # MLA absorbs its weight into attention
    # decode batches of up to this many rows run the decode-size GEMM (launched
    # dependently, as this family's other decode kernels are) in place of cuBLAS, whose
    # 175 launches took 2.37 ms of a 1 x 16K step at 81% of the copy rate, 23% of the
    # replay idle between kernels (H200, RESULTS.md run 137). 0 until measured in the
    # model; PDSERVE_SKINNY_ROWS=1 tries it.
    skinny_rows = 0

    def __init__(
        self,
        config: HFModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        with_mtp: bool = False,
        groups: ParallelGroups = ParallelGroups(),
    ) -> None:
        super().__init__(config, dtype)
        self.groups = groups
        if config.hidden_act != "silu":
            raise ValueError(f"{config.path}: hidden_act {config.hidden_act!r} is not supported")
        self.dc = read_deepseek_config(config)
        if with_mtp and not self.dc.num_nextn_predict_layers:
            raise ValueError(
                f"{config.path}: the model has no MTP layer (num_nextn_predict_layers)"
            )
        self.with_mtp = with_mtp
        self.model = DeepseekModel(config, self.dc, dtype, with_mtp, groups)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype, tied=tied, tp=groups.tp)

    def configure_decode(self) -> None:
        enable_skinny(self, self.skinny_rows)

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return [m for m in self.model.layers[self.model.num_layers :] if isinstance(m, MTPLayer)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def fp8_activation_links(self) -> list[tuple[str, list[str]]]:
        """Per layer (MTP layers too): the input norm feeds q_a (or q) and kv_a, and the
        DSA indexer where the layer has one; q_a's norm feeds q_b and the indexer; the
        post-attention norm feeds a dense MLP's gate/up, or an MoE's router, routed
        experts and shared experts; each SiLU-and-mul its down projection."""
        links: list[tuple[str, list[str]]] = []
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, DeepseekDecoderLayer)
            p, attn = f"model.layers.{i}.", layer.self_attn
            indexer = [p + "self_attn.indexer"] if attn.indexer is not None else []
            a_in = ["fused_qkv_a_proj"] if attn.dc.q_lora_rank is not None else [
                "q_proj", "kv_a_proj_with_mqa"]  # fmt: skip
            links.append((p + "input_layernorm", [p + f"self_attn.{n}" for n in a_in] + indexer))
            if attn.dc.q_lora_rank is not None:
                links.append((p + "self_attn.q_a_layernorm", [p + "self_attn.q_b_proj"] + indexer))
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                moe = [p + "mlp.gate", p + "mlp.experts"]
                if mlp.shared_experts is not None:
                    moe.append(p + "mlp.shared_experts.gate_up_proj")
                    links.append(
                        (p + "mlp.shared_experts.act_fn", [p + "mlp.shared_experts.down_proj"])
                    )
                links.append((p + "post_attention_layernorm", moe))
            else:
                links.append((p + "post_attention_layernorm", [p + "mlp.gate_up_proj"]))
                links.append((p + "mlp.act_fn", [p + "mlp.down_proj"]))
        return links

    def mtp_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        step: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP draft pass: (draft logits [T, V], post-norm hidden [T, H]). Slot i gets
        token t_{i+1} and the hidden state h_i it follows; draft step ``step`` uses MTP
        layer ``step % num_nextn_predict_layers``."""
        hidden, _ = self.mtp_hidden(input_ids, positions, prev_hidden, step)
        return self.compute_logits(hidden), hidden

    def mtp_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        step: int = 0,
        shared_topk: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`mtp_forward` without the logits: (post-norm hidden, the top-k used).
        Input ids below 0 (placeholders) are embedded as token 0."""
        layers = self.mtp_layers
        if not layers:
            raise RuntimeError("the model was built without its MTP layers (with_mtp=False)")
        embeds = self.model.embed_tokens(input_ids.clamp(min=0))
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        rope = self.model.rotary_emb.prepare(positions)
        return layers[step % len(layers)].predict(embeds, prev_hidden, rope, shared_topk)

    # -- checkpoint ------------------------------------------------------------------------
    def _entries(self) -> dict[str, tuple[torch.Tensor, Shard | None]]:
        """Checkpoint name -> (tensor, this rank's shard), with the stacked experts as
        per-expert names."""
        out: dict[str, tuple[torch.Tensor, Shard | None]] = {}
        experts = {name: mod for name, mod in self.named_modules() if isinstance(mod, MoE)}
        for name, entry in checkpoint_entries(self).items():
            head, _, leaf = name.rpartition(".experts.")
            if head in experts and leaf in dict(experts[head].experts.named_parameters()):
                if leaf == "w13":
                    routed = experts[head].experts
                    shards = routed.expert_shards()
                    for e in routed.local_expert_ids:
                        for part, view in routed.expert_views(e).items():
                            out[f"{head}.experts.{e}.{part}"] = (view, shards.get(part))
                continue
            out[name] = entry
        return out

    def _targets(self) -> dict[str, torch.Tensor]:
        return {name: t for name, (t, _) in self._entries().items()}

    def checkpoint_shards(self) -> dict[str, Shard]:
        return {name: s for name, (_, s) in self._entries().items() if s is not None}

    def checkpoint_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """In the order random checkpoints draw them: each layer's as its modules were
        before ``fused_qkv_a_proj`` merged three of them (:func:`_unmerged_order`), so
        random and dummy weights stay those of earlier commits (benchmarks compare trees
        on them)."""
        targets = self._targets()
        return {n: (tuple(targets[n].shape), targets[n].dtype) for n in _unmerged_order(targets)}

    def checkpoint_tensor_names(self) -> set[str]:
        return set(self._targets())

    def is_foreign_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to another expert-parallel rank (a
        routed expert, or its FP8 scale, that this rank does not hold)."""
        head, sep, rest = name.partition(".experts.")
        if not sep or self.groups.ep.size == 1:
            return False
        e = rest.split(".", 1)[0]
        if not e.isdigit():
            return False
        try:
            moe = self.get_submodule(head)
        except AttributeError:  # e.g. an MTP layer that was not built
            return False
        return isinstance(moe, MoE) and int(e) not in moe.experts.local_expert_ids

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        targets = self._targets()
        n = self.config.num_hidden_layers
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(".rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if _is_mtp(name, n) and (not self.with_mtp or name.split(".", 3)[3] in _MTP_SHARED):
                continue  # MTP not built, or a copy of the target's own head/embedding
            if load_kv_scale(self, name, tensor):  # the FP8 latent cache's scale
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


def _hp(x: torch.Tensor | Fp8Activation) -> torch.Tensor:
    """A producer's own-dtype output, also where it emits an FP8 activation for its FP8
    consumers (then it keeps that output beside it: ``fuse_fp8_activations``)."""
    return x.high_precision() if isinstance(x, Fp8Activation) else x


# a merged part -> the tensor it followed when it was its own module (same layer)
_DRAWN_AFTER = {
    "self_attn.kv_a_proj_with_mqa.": "self_attn.q_b_proj.",
    "self_attn.indexer.wk.": "self_attn.indexer.wq_b.",
}


def _unmerged_order(names: Iterable[str]) -> list[str]:
    """``names`` (named-module order) with each part of a layer's ``fused_qkv_a_proj``
    but its first moved back after the tensors it followed before the merge (one pass:
    the merged layer comes before those tensors)."""
    moved: dict[str, list[str]] = {}  # anchor (layer prefix + tensor prefix) -> names
    out: list[str] = []
    names = list(names)
    for i, name in enumerate(names):
        for part, anchor in _DRAWN_AFTER.items():
            head, sep, _ = name.partition(part)
            if sep:  # a merged part: drawn later
                moved.setdefault(head + anchor, []).append(name)
                break
        else:
            out.append(name)
            for anchor in _DRAWN_AFTER.values():
                head, sep, _ = name.partition(anchor)
                nxt = names[i + 1] if i + 1 < len(names) else ""
                if sep and not nxt.startswith(head + anchor):  # the anchor's last tensor
                    out += moved.pop(head + anchor, [])
    return out + [n for group in moved.values() for n in group]


def _is_mtp(name: str, num_layers: int) -> bool:
    parts = name.split(".")
    return (
        len(parts) > 3
        and parts[0] == "model"
        and parts[1] == "layers"
        and parts[2].isdigit()
        and int(parts[2]) >= num_layers
    )


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: V3 plus the DSA indexer (half-split RoPE in the indexer)."""


class GlmMoeDsaForCausalLM(DeepseekV3ForCausalLM):
    """GLM-5 / GLM-5.2: DeepSeek-V3.2's shape with interleaved indexer RoPE and (5.2)
    index sharing across layers."""
