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


def test_glm5_fp8_producers_keep_bf16_beside_for_router_and_indexer(tiny_deepseek: dict) -> None:
    """GLM-5 and DeepSeek-V3 (MTP layers too): every norm and SiLU-and-mul goes fp8. The
    norms that also feed the DSA indexer (input and q_a norms, GLM-5) or the MoE router
    (post-attention norm of an MoE layer) keep their bf16 output beside the fp8 one."""
    for arch, indexer in (("GlmMoeDsaForCausalLM", True), ("DeepseekV3ForCausalLM", False)):
        model, _ = load_model(tiny_deepseek[arch], "float32", quantization="fp8", with_mtp=True)
        got = _fp8_producers(model)
        for i, layer in enumerate(model.model.layers):
            p = f"model.layers.{i}."
            moe = hasattr(layer.mlp, "gate")
            act = p + ("mlp.shared_experts.act_fn" if moe else "mlp.act_fn")
            norms = ("input_layernorm", "self_attn.q_a_layernorm", "post_attention_layernorm")
            assert {act, *(p + n for n in norms)} <= got, p
            assert (layer.self_attn.indexer is not None) == indexer
            assert layer.input_layernorm.quant_keep_hp == indexer
            assert layer.self_attn.q_a_layernorm.quant_keep_hp == indexer
            assert layer.post_attention_layernorm.quant_keep_hp == moe
        assert not model.model.norm.quant_out  # the bf16 LM head
        ids = list(range(3, 24))
        fp8_act = _logits(model, ids)
        _all_bf16(model)
        assert torch.equal(fp8_act, _logits(model, ids)), arch


def test_expert_parallel_experts_read_the_bf16_output() -> None:
    """Expert parallelism dispatches the bf16 rows: its experts count as a bf16 reader."""
    from pdserve.distributed import Group
    from pdserve.layers.moe import RoutedExperts
    from pdserve.models.quantization import _consumer_kind

    with torch.device("meta"):
        local = RoutedExperts(4, 128, 128, torch.float32)
        spread = RoutedExperts(4, 128, 128, torch.float32, ep=Group(size=2, rank=0, ranks=(0, 1)))
    assert _consumer_kind(local) == "hp"  # bf16 experts
    for experts in (local, spread):
        experts.use_fp8(torch.device("meta"))
    assert _consumer_kind(local) == "fp8" and _consumer_kind(spread) == "hp"
