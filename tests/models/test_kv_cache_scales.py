"""Per-layer FP8 KV cache scales: from the checkpoint (ModelOpt names in the weights, or
``kv_cache_scales.safetensors`` from ``make-checkpoint --kv-cache-scales``) to decode
logits, with the torch backends (the Triton ones: ``tests/kernels/test_fp8.py``).

Closeness: with K/V (MLA: latent rows) up to ~1000x beyond +-448, a decode step reading
the fp8 cache with the checkpoint's scales stays within 5% (of the largest |logit|) of
the float32-cache step and well closer than scale 1.0, which saturates them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from _kv_scaled import decode_logits, drop_kv_scales, loud_kv_checkpoint
from _pd_engines import PROMPTS
from pdserve.layers.attention.kv_scale import FP8CacheScales
from pdserve.layers.moe import TopKRouter
from pdserve.models import load_model
from pdserve.models.kv_scales import KV_SCALES_FILE
from pdserve.runner.model_step import collect_cache_layers, kv_cache_scales

STEPS = [8, 5, 1]  # a prompt, a chunk over its cached prefix, a decode step


def _scales(model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    return {n: m.kv_scales() for n, m in model.named_modules() if isinstance(m, FP8CacheScales)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("arch,factor", [("llama", 2000.0), ("glm5", 500.0)])
def test_checkpoint_scales_keep_loud_kv_close_to_float(
    tiny_llama: Path, tiny_glm5: Path, tmp_path: Path, arch: str, factor: float
) -> None:
    src = tiny_llama if arch == "llama" else tiny_glm5
    scales = loud_kv_checkpoint(src, tmp_path / "loud", factor)
    assert len(scales) == (4 if arch == "llama" else 5)  # GLM-5: k_scale only, MTP included
    assert min(float(s) for s in scales.values()) * 448 > 448  # amax beyond e4m3's range
    model, _ = load_model(tmp_path / "loud", "float32")
    for m in model.modules():  # every expert: no top-2 choice flips on a near-tie
        if isinstance(m, TopKRouter):
            m.top_k = m.weight.shape[0]
    loaded = _scales(model)
    name = "model.layers.0.self_attn"
    assert loaded[f"{name}.attn"][0] == pytest.approx(float(scales[f"{name}.k_scale"]))
    ids = PROMPTS[3][: sum(STEPS)]  # within the GLM-5's index_topk: the same keys either way
    ref = decode_logits(model, ids, False, STEPS, "torch")
    scaled = decode_logits(model, ids, True, STEPS, "torch")
    drop_kv_scales(model)
    plain = decode_logits(model, ids, True, STEPS, "torch")
    assert _rel(scaled, ref) < 0.05
    assert _rel(scaled, ref) < 0.25 * _rel(plain, ref)


def test_scales_with_a_float_cache_are_ignored_and_logged_once(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loud_kv_checkpoint(tiny_llama, tmp_path / "loud", 2000.0)
    model, _ = load_model(tmp_path / "loud", "float32")
    with caplog.at_level("INFO", logger="pdserve.runner.model_step"):
        cfg, layers = collect_cache_layers(model, 4, "float32")
    assert [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()] == [
        "the checkpoint's KV cache scales (2 layers, e.g. model.layers.0.self_attn.attn) are "
        "ignored: the KV cache is float32, not fp8 (--kv-cache-dtype fp8 uses them)"
    ]
    assert kv_cache_scales(cfg, layers) == {}
    ids = PROMPTS[3][: sum(STEPS)]
    with_scales = decode_logits(model, ids, False, STEPS, "torch")
    drop_kv_scales(model)
    assert torch.equal(with_scales, decode_logits(model, ids, False, STEPS, "torch"))
    cfg, layers = collect_cache_layers(model, 4, "float32", "float8_e4m3fn")
    assert kv_cache_scales(cfg, layers) == {
        f"model.layers.{i}.self_attn.attn": [1.0, 1.0] for i in range(2)
    }


def _with_scales_file(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    import shutil

    shutil.copytree(src, dst)
    save_file(tensors, dst / KV_SCALES_FILE)
    return dst


def test_scales_file_loads_with_both_load_formats_and_skips_unbuilt_mtp(
    tiny_glm5: Path, tmp_path: Path
) -> None:
    one = torch.tensor(0.5)
    names = {f"model.layers.{i}.self_attn.k_scale": one * (i + 1) for i in range(5)}
    d = _with_scales_file(tiny_glm5, tmp_path / "c", names)
    for fmt in ("auto", "dummy"):
        model, _ = load_model(d, "float32", load_format=fmt)  # MTP (layer 4) not built
        assert _scales(model)["model.layers.2.self_attn.attn"] == (1.5, 1.5)
    model, _ = load_model(d, "float32", with_mtp=True)
    assert _scales(model)["model.layers.4.self_attn.attn"] == (2.5, 2.5)


@pytest.mark.parametrize(
    "tensors,needle",
    [
        ({"model.layers.0.mlp.k_scale": torch.tensor(1.0)}, "no attention module"),
        ({"model.layers.0.self_attn.k_scale": torch.ones(2)}, "only one KV cache scale"),
        ({"model.layers.0.self_attn.v_scale": torch.tensor(0.0)}, "must be positive"),
        ({"model.layers.0.self_attn.q_proj.weight": torch.ones(1)}, "not a KV cache scale"),
    ],
)
def test_bad_scales_are_refused_naming_the_tensor(
    tiny_llama: Path, tmp_path: Path, tensors: dict[str, torch.Tensor], needle: str
) -> None:
    d = _with_scales_file(tiny_llama, tmp_path / "c", tensors)
    with pytest.raises(ValueError, match=needle) as e:
        load_model(d, "float32")
    assert str(d / KV_SCALES_FILE) in str(e.value) and next(iter(tensors)) in str(e.value)


def test_mla_v_scale_must_equal_k_scale(tiny_glm5: Path, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn"
    same = {f"{name}.k_scale": torch.tensor(0.25), f"{name}.v_scale": torch.tensor(0.25)}
    model, _ = load_model(_with_scales_file(tiny_glm5, tmp_path / "a", same), "float32")
    assert _scales(model)[f"{name}.attn"] == (0.25, 0.25)
    differ = {**same, f"{name}.v_scale": torch.tensor(0.5)}
    with pytest.raises(ValueError, match="one scale, but k_scale and v_scale differ"):
        load_model(_with_scales_file(tiny_glm5, tmp_path / "b", differ), "float32")


def test_make_checkpoint_kv_cache_scales(tmp_path: Path) -> None:
    """``--kv-cache-scales`` writes one k_scale and v_scale per layer beside the weights;
    ``--config-only`` calibrates the weights
    ``--load-format dummy`` draws, so it writes the same scales."""
    from safetensors import safe_open

    from pdserve.cli import main

    argv = ["make-checkpoint", "--arch", "LlamaForCausalLM", "--preset", "tiny"]
    argv += ["--dtype", "float32", "--seed", "3", "--kv-cache-scales"]
    assert main([*argv, "--out", str(tmp_path / "full")]) == 0
    assert main([*argv, "--out", str(tmp_path / "cfg"), "--config-only"]) == 0
    files = [tmp_path / d / KV_SCALES_FILE for d in ("full", "cfg")]
    stored = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            stored.append({n: f.get_tensor(n) for n in f.keys()})  # noqa: SIM118
    assert sorted(stored[0]) == [
        f"model.layers.{i}.self_attn.{kv}_scale" for i in range(2) for kv in "kv"
    ]
    assert all(t.shape == () and t.dtype == torch.float32 for t in stored[0].values())
    torch.testing.assert_close(stored[1], stored[0])
    model, _ = load_model(tmp_path / "full", "float32")
    k, v = _scales(model)["model.layers.1.self_attn.attn"]
    assert (k, v) == (
        float(stored[0]["model.layers.1.self_attn.k_scale"]),
        float(stored[0]["model.layers.1.self_attn.v_scale"]),
    )
    # rewriting without the flag drops the old scales
    assert main([*argv[:-1], "--out", str(tmp_path / "full")]) == 0
    assert not files[0].exists()


def test_transformers_loads_a_checkpoint_with_kv_cache_scales(tmp_path: Path) -> None:
    """The scales live in a file of their own, which transformers never opens."""
    transformers = pytest.importorskip("transformers")
    from pdserve.testing.checkpoint import make_checkpoint

    d = make_checkpoint("LlamaForCausalLM", "tiny", tmp_path, dtype="float32", kv_cache_scales=True)
    assert (d / KV_SCALES_FILE).is_file()
    transformers.AutoModelForCausalLM.from_pretrained(d)
