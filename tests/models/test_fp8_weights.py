"""Block-scaled FP8 checkpoints: the format make-checkpoint writes, loading it, quantizing
at load, and the logits against the dequantized reference.

Tolerances (max |logit difference| over max |logit|, 37-token prompt): the FP8 model
quantizes every linear's input per token per 128 channels, which the dequantized
reference does not; on the tiny random models that costs up to ~3% for Llama (bound
5%) and ~7% for GLM-5 (bound 12%, with every expert routed and the prompt within
index_topk, so no routing or top-k choice flips; with top-2 routing a near-tie flips
and the error is no longer a quantization error).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from _attn_helper import PagedKV
from pdserve.kernels.reference import FP8_DTYPE, dequantize_fp8_blocks, dequantize_fp8_experts
from pdserve.layers.fp8 import Fp8Linear, Fp8MergedLinear
from pdserve.layers.moe import RoutedExperts, TopKRouter
from pdserve.models import load_model
from pdserve.testing.checkpoint import make_checkpoint


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    kv = PagedKV(model, 1, 64)
    with kv.step([0], [len(ids)]):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
    return model.compute_logits(hidden)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.view(torch.uint8) if v.dtype == FP8_DTYPE else v for k, v in model.state_dict().items()
    }


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the tiny_llama fixture's values (seed 1), quantized
    out = tmp_path_factory.mktemp("fp8_llama")
    return make_checkpoint(
        "LlamaForCausalLM", "tiny", out, seed=1, dtype="float32", quantization="fp8"
    )


def test_make_checkpoint_writes_block_fp8(fp8_llama: Path) -> None:
    cfg = json.loads((fp8_llama / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
        "modules_to_not_convert": ["lm_head"],
    }
    with safe_open(str(fp8_llama / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        w = f.get_tensor("model.layers.0.mlp.down_proj.weight")  # [64, 128]
        s = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
        assert w.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (1, 1)
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    fp8 = {n for n in names if n.endswith("_proj.weight")}
    assert len(fp8) == 14 and {n + "_scale_inv" for n in fp8} <= names


def test_fp8_checkpoint_loads_and_matches_dequantized_reference(
    fp8_llama: Path, tiny_llama: Path
) -> None:
    model, _ = load_model(fp8_llama, "float32")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8MergedLinear) and qkv.weight.dtype == FP8_DTYPE
    assert qkv.scale_rows == 1  # q is 64 rows: parts off the 128-row grid keep per-row scales
    assert (
        type(model.lm_head.weight) is torch.nn.Parameter
        and model.lm_head.weight.dtype == torch.float32
    )
    # the same values three ways: the FP8 file, a float32 file quantized at load, dummy
    at_load, _ = load_model(tiny_llama, "float32", quantization="fp8")
    dummy, _ = load_model(fp8_llama, "float32", load_format="dummy", seed=1)
    want = _state(model)
    for other in (at_load, dummy):
        got = _state(other)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    # reference: the plain model with every FP8 weight dequantized
    ref, _ = load_model(tiny_llama, "float32")
    for name, mod in model.named_modules():
        if isinstance(mod, Fp8Linear):
            dense = dequantize_fp8_blocks(mod.weight, mod.weight_scale_inv, (mod.scale_rows, 128))
            ref.get_submodule(name).weight.data.copy_(dense)
    ids = list(range(3, 40))
    assert _rel(_logits(model, ids), _logits(ref, ids)) < 0.05


def route_to_all_experts(model: torch.nn.Module) -> None:
    """Every token to every expert: no top-2 choice can flip on a near-tie."""
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.top_k = m.weight.shape[0]


def test_glm5_fp8_checkpoint(tiny_glm5: Path, tmp_path: Path) -> None:
    # the tiny_glm5 fixture's values (seed 2), quantized
    q = make_checkpoint("GlmMoeDsaForCausalLM", "tiny", tmp_path, 2, "float32", quantization="fp8")
    cfg = json.loads((q / "config.json").read_text())["quantization_config"]
    assert cfg["modules_to_not_convert"] == ["lm_head", "weights_proj"]
    with safe_open(str(q / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight").dtype == FP8_DTYPE
        assert f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv").shape == (
            1,
            2,
        )
        assert f.get_tensor("model.layers.1.self_attn.kv_b_proj.weight").dtype == FP8_DTYPE
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32
        assert (
            f.get_tensor("model.layers.1.self_attn.indexer.weights_proj.weight").dtype
            == torch.float32
        )
    model, _ = load_model(q, "float32")
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.q_b_proj, Fp8Linear) and isinstance(attn.fused_qkv_a_proj, Fp8Linear)
    # the indexer's wk is a part of the merged q_a | wk | kv_a GEMM
    assert list(attn.fused_qkv_a_proj.parts) == ["q_a_proj", "indexer.wk", "kv_a_proj_with_mqa"]
    assert attn.indexer.wk is None
    # MLA reads kv_b_proj whole: dequantized at load
    assert (
        not isinstance(attn.kv_b_proj, Fp8Linear) and attn.kv_b_proj.weight.dtype == torch.float32
    )
    # the routed experts stay FP8, each expert's projections with its own 128x128 scales
    experts = model.model.layers[1].mlp.experts
    assert experts.w13.dtype == FP8_DTYPE and experts.w2.dtype == FP8_DTYPE
    assert experts.w13_scale_inv.shape == (8, 2, 2) and experts.w2_scale_inv.shape == (8, 2, 1)
    with safe_open(str(q / "model.safetensors"), "pt") as f:
        up = f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight")
        up_scale = f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv")
    views = experts.expert_views(3)
    assert torch.equal(views["up_proj.weight"].view(torch.uint8), up.view(torch.uint8))
    assert torch.equal(views["up_proj.weight_scale_inv"], up_scale)
    fp8_bytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    bf16_bytes = 2 * (experts.w13.numel() + experts.w2.numel())
    assert fp8_bytes < 0.51 * bf16_bytes  # the weights halve; the scales add ~0.02%
    at_load, _ = load_model(tiny_glm5, "float32", quantization="fp8")
    want, got = _state(model), _state(at_load)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ref, _ = load_model(tiny_glm5, "float32")
    for name, mod in model.named_modules():
        if isinstance(mod, Fp8Linear):
            dense = dequantize_fp8_blocks(mod.weight, mod.weight_scale_inv, (mod.scale_rows, 128))
            ref.get_submodule(name).weight.data.copy_(dense)
        elif isinstance(mod, RoutedExperts):
            w13, w2 = dequantize_fp8_experts(mod.w13, mod.w13_scale_inv, mod.w2, mod.w2_scale_inv)
            ref.get_submodule(name).load_state_dict({"w13": w13, "w2": w2})
        elif name.endswith("kv_b_proj"):
            ref.get_submodule(name).load_state_dict(mod.state_dict())
    route_to_all_experts(model)
    route_to_all_experts(ref)
    ids = list(range(3, 15))  # within index_topk (16): the indexer keeps every key
    assert _rel(_logits(model, ids), _logits(ref, ids)) < 0.12


def _with_quant(src: Path, dst: Path, quant: dict | None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "change,message",
    [
        ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
        ({"fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
        ({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\] is not supported"),
        ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    ],
)
def test_other_quantization_is_refused(
    fp8_llama: Path, tmp_path: Path, change: dict, message: str
) -> None:
    quant = {**json.loads((fp8_llama / "config.json").read_text())["quantization_config"], **change}
    with pytest.raises(ValueError, match=message):
        load_model(_with_quant(fp8_llama, tmp_path / "m", quant), "float32")


def test_bad_flag_and_missing_scale_are_refused(
    fp8_llama: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="--quantization 'int8' is not supported"):
        load_model(tiny_llama, "float32", quantization="int8")
    d = _with_quant(fp8_llama, tmp_path / "m", None)  # FP8 tensors, no quantization_config
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if not n.endswith("o_proj.weight_scale_inv")]  # noqa: SIM118
        tensors = {n: f.get_tensor(n) for n in names}
    from safetensors.torch import save_file

    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="o_proj.weight' has no weight_scale_inv"):
        load_model(d, "float32")


def test_transformers_loads_the_fp8_checkpoint(fp8_llama: Path, tiny_llama: Path) -> None:
    """transformers' fine-grained FP8 integration needs accelerate; without a GPU it
    dequantizes the weights as it loads (with a GPU of compute capability >= 8.9 it runs
    them in FP8 through its own kernels)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    hf = transformers.AutoModelForCausalLM.from_pretrained(fp8_llama, dtype=torch.float32)
    with safe_open(str(fp8_llama / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.1.self_attn.o_proj.weight")
        s = f.get_tensor("model.layers.1.self_attn.o_proj.weight_scale_inv")
    dense = dequantize_fp8_blocks(w, s, (128, 128))
    torch.testing.assert_close(
        hf.model.layers[1].self_attn.o_proj.weight.float(), dense, atol=0, rtol=8e-3
    )
    ids = list(range(3, 40))
    with torch.no_grad():
        hf_logits = hf(torch.tensor([ids])).logits[0].float()
    ours, _ = load_model(fp8_llama, "float32")
    assert _rel(_logits(ours, ids), hf_logits) < 0.05
