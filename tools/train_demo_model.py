"""Model side of ``tools/train_demo.py``: the config presets, the MTP module, the losses
and the checkpoint writer.

The trunk is transformers' ``GlmMoeDsaForCausalLM``. transformers has no MTP layer, so
:class:`MTPHead` assembles one from its parts, exactly as
``tests/models/test_glm5_engine.py`` builds its reference: ``eh_proj([enorm(e_{t+1}),
hnorm(h_t)])`` through one sparse decoder block with its own indexer, then
``shared_head.norm`` and the trunk's LM head. Slot t sees the trunk's post-norm hidden
state h_t and the embedding of token t+1 (zeroed at position 0, as pdserve's drafter does)
and predicts token t+2. Loss: ``CE_main + mtp_weight * CE_mtp`` (DeepSeek-V3 style).

Two things transformers' modules do not do in training, added here with hooks:

* the DSA indexer runs under ``torch.no_grad`` in transformers, so its weights would stay
  at their random init. :class:`IndexerDistill` trains them as DeepSeek-V3.2 does in its
  dense warm-up: KL(main attention, summed over heads and L1-normalised || softmax of the
  indexer's scores), the indexer's inputs detached so this loss trains the indexer only;
* the router's ``e_score_correction_bias`` (aux-loss-free balancing) is a buffer that
  transformers never updates. :class:`RouterBalancer` counts each router's expert loads
  and after every optimizer step moves the bias by ``gamma * sign(mean_load - load)``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Config presets. "demo": the H200 run (bf16 checkpoint ~14 MiB, trunk + MTP). "micro":
# the CPU smoke test. vocab_size and the token ids are filled in from the tokenizer.
PRESETS: dict[str, dict[str, Any]] = {
    "demo": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        head_dim=16,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=64,
        max_position_embeddings=2048,
    ),
    "micro": dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=16,
        max_position_embeddings=512,
    ),
}


def build_config(preset: str, vocab_size: int, eos_ids: list[int], pad_id: int) -> dict[str, Any]:
    """The ``config.json`` dict (the keys pdserve and transformers read for GLM-5)."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        **PRESETS[preset],
        "vocab_size": vocab_size,
        "num_nextn_predict_layers": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_interleave": True,
        "indexer_rope_interleave": True,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": pad_id,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def hf_model(config: dict[str, Any]) -> Any:
    """transformers' trunk, randomly initialised (by the caller's torch seed), float32."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = GlmMoeDsaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    cfg._attn_implementation = "sdpa"
    return GlmMoeDsaForCausalLM(cfg).float()


def causal_mask(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """[B, 1, S, S] boolean, True where a query may attend."""
    m = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    return m[None, None].expand(batch, 1, seq, seq)


class MTPHead(nn.Module):
    """The MTP layer from transformers' parts (layer index ``num_hidden_layers``)."""

    def __init__(self, trunk: Any) -> None:
        super().__init__()
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

        cfg = copy.deepcopy(trunk.config)
        cfg.num_hidden_layers = 1
        cfg.mlp_layer_types = ["sparse"]
        cfg.indexer_types = ["full"]
        cfg.layer_types = list(trunk.config.layer_types[:1])  # the name differs by version
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.block = hf_glm.GlmMoeDsaDecoderLayer(cfg, 0)
        self.enorm = hf_glm.GlmMoeDsaRMSNorm(h, eps)
        self.hnorm = hf_glm.GlmMoeDsaRMSNorm(h, eps)
        self.shared_head_norm = hf_glm.GlmMoeDsaRMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        # the trunk's own initialiser for the new block (routers, experts, linears)
        self.block.apply(trunk._init_weights)
        nn.init.normal_(self.eh_proj.weight, std=cfg.initializer_range)

    def forward(self, trunk: Any, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Post-norm MTP hidden states [B, S, H] for slots 0..S-1: slot t conditions on
        ``hidden[:, t]`` (the trunk's post-norm state) and token ``next_ids[:, t]``."""
        b, s, _ = hidden.shape
        pos = torch.arange(s, device=hidden.device)
        e = trunk.model.embed_tokens(next_ids)
        e = e.masked_fill((pos == 0)[None, :, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        rope = trunk.model.rotary_emb(x, pos[None].expand(b, s))
        out = self.block(x, attention_mask=causal_mask(b, s, x.device), position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return self.shared_head_norm(out)


def lm_losses(
    trunk: Any, mtp: MTPHead, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE of the trunk's next token, CE of the MTP's token after next, MTP top-1 accuracy)
    over a batch of windows ``ids`` [B, S+1]."""
    x, y = ids[:, :-1], ids[:, 1:]
    hidden = trunk.model(input_ids=x).last_hidden_state
    logits = trunk.lm_head(hidden)
    ce_main = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    # slot t: (h_t, token t+1) -> token t+2
    h_mtp = mtp(trunk, hidden[:, :-1], y[:, :-1])
    mtp_logits = trunk.lm_head(h_mtp).flatten(0, 1).float()
    target = y[:, 1:].flatten()
    ce_mtp = F.cross_entropy(mtp_logits, target)
    acc = (mtp_logits.argmax(-1) == target).float().mean()
    return ce_main, ce_mtp, acc.detach()


class IndexerDistill:
    """Collects the DSA indexers' KL loss during training forwards (see module doc)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

        self._rope = hf_glm.apply_rotary_pos_emb_interleave
        self.active = False
        self.losses: list[torch.Tensor] = []
        self.handles = [
            m.register_forward_hook(self._hook, with_kwargs=True)
            for m in modules
            if isinstance(m, hf_glm.GlmMoeDsaAttention) and m.indexer is not None
        ]

    def take(self) -> torch.Tensor | None:
        out = torch.stack(self.losses).mean() if self.losses else None
        self.losses = []
        return out

    def _hook(self, attn: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not self.active:
            return
        x = (args[0] if args else kwargs["hidden_states"]).detach().float()
        cos, sin = (t.float() for t in kwargs["position_embeddings"])
        with torch.autocast(x.device.type, enabled=False):  # float32 throughout
            self.losses.append(self._kl(attn, x, cos, sin))

    def _kl(self, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        with torch.no_grad():  # the target: the main attention, summed over heads
            q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
            q = attn.q_b_proj(q_resid).view(b, s, -1, attn.qk_head_dim).transpose(1, 2)
            q_pass, q_rot = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
            kv_pass, k_rot = attn.kv_a_proj_with_mqa(x).split(
                [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1
            )
            k_pass = attn.kv_a_layernorm(kv_pass).view(b, 1, s, attn.kv_lora_rank)
            q_rot, k_rot = self._rope(q_rot, k_rot.view(b, 1, s, -1), cos, sin)
            keys, _ = attn.expand_kv(k_pass, k_rot)
            scores = torch.cat([q_pass, q_rot], -1).float() @ keys.float().transpose(-1, -2)
            probs = (scores * attn.scaling).masked_fill(~mask, float("-inf")).softmax(-1)
            target = probs.sum(1)
            target = target / target.sum(-1, keepdim=True)
        logits = _indexer_scores(attn.indexer, x, q_resid.detach(), cos, sin, self._rope)
        logq = logits.masked_fill(~mask, -1e9).log_softmax(-1)
        kl = (target * (target.clamp_min(1e-12).log() - logq)).sum(-1)
        return kl.mean()


def _indexer_scores(
    idx: Any, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    rope: Any,
) -> torch.Tensor:  # fmt: skip
    """The indexer's scores [B, S, T] as transformers computes them, with gradients."""
    b, s, _ = x.shape
    r = idx.qk_rope_head_dim
    q = idx.wq_b(q_resid).view(b, s, idx.n_heads, idx.head_dim)
    k = idx.k_norm(idx.wk(x)).unsqueeze(2)
    q_rot, k_rot = rope(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., r:]], -1).float()
    k = torch.cat([k_rot, k[..., r:]], -1).squeeze(2).float()
    scores = F.relu(torch.einsum("bshd,btd->bsht", q, k) * idx.softmax_scale)
    w = idx.weights_proj(x.to(idx.weights_proj.weight.dtype)).float() * idx.n_heads**-0.5
    return torch.einsum("bsh,bsht->bst", w, scores)


class RouterBalancer:
    """Aux-loss-free load balancing of every router (see module doc)."""

    def __init__(self, modules: list[nn.Module], gamma: float) -> None:
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

        self.gamma = gamma
        self.active = False
        self.routers = [m for m in modules if isinstance(m, hf_glm.GlmMoeDsaTopkRouter)]
        self.loads = [torch.zeros(r.num_experts) for r in self.routers]
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._make_hook(i))

    def _make_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.active:
                idx = output[2].flatten()
                load = torch.bincount(idx, minlength=self.loads[i].numel())
                self.loads[i] = self.loads[i].to(idx.device) + load

        return hook

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """Move each bias one step; returns the worst max/mean expert load ratio of the
        step (a device scalar: no host sync unless the caller reads it)."""
        worst = torch.zeros(())
        for r, counts in zip(self.routers, self.loads, strict=True):
            load = counts.float()
            bias: torch.Tensor = r.e_score_correction_bias
            bias += self.gamma * torch.sign(load.mean() - load).to(bias.device)
            worst = torch.maximum(worst.to(load.device), load.max() / load.mean().clamp_min(1))
        self.loads = [torch.zeros_like(x) for x in self.loads]
        return worst


# --------------------------------------------------------------------------- saving
def export_tensors(trunk: Any, mtp: MTPHead) -> dict[str, torch.Tensor]:
    """Published GLM-5 tensor names (experts per expert; the MTP layer at index
    ``num_hidden_layers``), float32 on the CPU."""
    n = trunk.config.num_hidden_layers
    out: dict[str, torch.Tensor] = {}

    def add_block(prefix: str, sd: dict[str, torch.Tensor]) -> None:
        for k, v in sd.items():
            if k.endswith("mlp.experts.gate_up_proj"):
                head = k[: -len("gate_up_proj")]
                for e in range(v.shape[0]):
                    gate, up = v[e].chunk(2, dim=0)
                    out[f"{prefix}{head}{e}.gate_proj.weight"] = gate
                    out[f"{prefix}{head}{e}.up_proj.weight"] = up
            elif k.endswith("mlp.experts.down_proj"):
                head = k[: -len("down_proj")]
                for e in range(v.shape[0]):
                    out[f"{prefix}{head}{e}.down_proj.weight"] = v[e]
            elif not k.endswith("rotary_emb.inv_freq"):
                out[prefix + k] = v

    add_block("", dict(trunk.state_dict()))
    pre = f"model.layers.{n}."
    add_block(pre, dict(mtp.block.state_dict()))
    out[pre + "enorm.weight"] = mtp.enorm.weight
    out[pre + "hnorm.weight"] = mtp.hnorm.weight
    out[pre + "eh_proj.weight"] = mtp.eh_proj.weight
    out[pre + "shared_head.norm.weight"] = mtp.shared_head_norm.weight
    return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}


def save_checkpoint(
    out: Path, config: dict[str, Any], trunk: Any, mtp: MTPHead, tokenizer_dir: Path
) -> Path:
    """The published HF layout in bf16 (the router in float32, as pdserve declares it):
    every name and shape is checked against pdserve's own list for ``config``."""
    import shutil

    from safetensors.torch import save_file

    from pdserve.testing.checkpoint import checkpoint_tensors

    specs = checkpoint_tensors(config, "bfloat16")
    tensors = export_tensors(trunk, mtp)
    missing, extra = set(specs) - set(tensors), set(tensors) - set(specs)
    if missing or extra:
        raise RuntimeError(f"checkpoint names differ: missing {sorted(missing)[:5]}, "
                           f"unexpected {sorted(extra)[:5]}")  # fmt: skip
    final: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in specs.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise RuntimeError(f"{name}: shape {tuple(t.shape)}, pdserve expects {shape}")
        final[name] = t.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(final, str(out / "model.safetensors"), {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in sorted(tokenizer_dir.iterdir()):
        if f.is_file():
            shutil.copyfile(f, out / f.name)
    return out
