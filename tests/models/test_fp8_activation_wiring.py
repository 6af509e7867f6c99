"""FP8 activations from their producers, wired at load (``fuse_fp8_activations``): which
norms and SiLU-and-mul layers emit fp8, and that the model computes the same values.

With the torch layers the producer quantizes its output exactly as the FP8 linear would
have (``quantize_fp8_groups``) and the linear only dequantizes it, so the logits are
bit for bit those of the model whose producers stay bf16."""

from __future__ import annotations

from pathlib import Path

import torch

from _attn_helper import PagedKV
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.norm import RMSNorm
from pdserve.models import load_model
from pdserve.models.quantization import fuse_fp8_activations


def _fp8_producers(model: torch.nn.Module) -> set[str]:
    return {
        name
        for name, m in model.named_modules()
        if isinstance(m, (RMSNorm, SiluAndMul)) and m.quant_out
    }


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    kv = PagedKV(model, 1, 64)
    with torch.no_grad(), kv.step([0], [len(ids)]):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def _all_bf16(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, (RMSNorm, SiluAndMul)):
            m.quant_out = False


def test_llama_fp8_producers_and_same_logits(tiny_llama: Path) -> None:
    model, cfg = load_model(tiny_llama, "float32", quantization="fp8")
    per_layer = {"input_layernorm", "post_attention_layernorm", "mlp.act_fn"}
    want = {f"model.layers.{i}.{p}" for i in range(cfg.num_hidden_layers) for p in per_layer}
    assert _fp8_producers(model) == want  # the final norm feeds the bf16 LM head
    ids = list(range(3, 30))
    fp8_act = _logits(model, ids)
    _all_bf16(model)
    assert _fp8_producers(model) == set()
    assert torch.equal(fp8_act, _logits(model, ids))
    plain, _ = load_model(tiny_llama, "float32")
    assert _fp8_producers(plain) == set() and fuse_fp8_activations(plain) == []


def test_glm5_fp8_producers_keep_bf16_for_router_and_indexer(tiny_deepseek: dict) -> None:
    """GLM-5 (indexer on every full layer): the input norms and q_a's norms feed the
    indexer and stay bf16; the MoE layers' post-attention norm feeds the router and stays
    bf16, their shared experts' SiLU-and-mul goes fp8; dense layers go fp8 throughout.
    DeepSeek-V3 (no indexer): the input and q_a norms go fp8 too."""
    for arch, indexer in (("GlmMoeDsaForCausalLM", True), ("DeepseekV3ForCausalLM", False)):
        model, _ = load_model(tiny_deepseek[arch], "float32", quantization="fp8", with_mtp=True)
        got = _fp8_producers(model)
        for i, layer in enumerate(model.model.layers):
            p = f"model.layers.{i}."
            moe = hasattr(layer.mlp, "gate")
            assert (p + "post_attention_layernorm" in got) == (not moe), p
            act = p + ("mlp.shared_experts.act_fn" if moe else "mlp.act_fn")
            assert act in got, act
            has_indexer = layer.self_attn.indexer is not None
            assert has_indexer == indexer
            for norm in ("input_layernorm", "self_attn.q_a_layernorm"):
                assert (p + norm in got) == (not has_indexer), p + norm
        ids = list(range(3, 24))
        fp8_act = _logits(model, ids)
        _all_bf16(model)
        assert torch.equal(fp8_act, _logits(model, ids)), arch
