"""The safetensors loader: dtypes, sharding, and an error that names the culprit for each fault."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.models import load_model
from pdserve.models.loader import INDEX_FILE, SINGLE_FILE, resolve_dtype
from pdserve.testing.checkpoint import make_checkpoint

LLAMA = "LlamaForCausalLM"


@pytest.fixture
def ckpt(tiny_ckpts: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the tiny float32 Llama checkpoint, free to break."""
    return Path(shutil.copytree(tiny_ckpts[LLAMA], tmp_path / "ckpt"))


def _rewrite(path: Path, change) -> None:
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, {"format": "pt"})


def test_unknown_architecture(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["FooBarForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert "FooBarForCausalLM" in msg and str(ckpt / "config.json") in msg
    assert "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg


def test_missing_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        load_model(ckpt)


def test_missing_weights_file(ckpt: Path) -> None:
    (ckpt / SINGLE_FILE).unlink()
    with pytest.raises(ValueError, match=SINGLE_FILE):
        load_model(ckpt)


def test_wrong_shape(ckpt: Path) -> None:
    name = "model.layers.1.mlp.down_proj.weight"
    _rewrite(ckpt / SINGLE_FILE, lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
    with pytest.raises(ValueError) as e:
        load_model(ckpt)
    assert name in str(e.value) and SINGLE_FILE in str(e.value)


def test_missing_tensor(ckpt: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(ckpt / SINGLE_FILE, lambda t: t.pop(name))
    with pytest.raises(ValueError) as e:
        load_model(ckpt)
    assert name in str(e.value) and SINGLE_FILE in str(e.value)


def test_unexpected_tensor(ckpt: Path) -> None:
    name = "model.layers.0.self_attn.extra_proj.weight"
    _rewrite(ckpt / SINGLE_FILE, lambda t: t.__setitem__(name, torch.zeros(2, 2)))
    with pytest.raises(ValueError) as e:
        load_model(ckpt)
    assert name in str(e.value) and SINGLE_FILE in str(e.value)


def test_derived_tensors_are_ignored(ckpt: Path) -> None:
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _rewrite(ckpt / SINGLE_FILE, lambda t: t.__setitem__(name, torch.ones(8)))
    load_model(ckpt)


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    single = make_checkpoint(LLAMA, "tiny", tmp_path / "single", seed=3, dtype="float32")
    sharded = make_checkpoint(
        LLAMA, "tiny", tmp_path / "sharded", seed=3, dtype="float32", max_shard_size=150_000
    )
    index = json.loads((sharded / INDEX_FILE).read_text())
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (sharded / SINGLE_FILE).exists()
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert all(p.stat().st_size <= 150_000 + 10_000 for p in shards)  # limit + header slack
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in load_file(single / SINGLE_FILE).values()
    )
    a, _ = load_model(single)
    b, _ = load_model(sharded)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


def test_index_pointing_at_missing_shard(tmp_path: Path) -> None:
    d = make_checkpoint(LLAMA, "tiny", tmp_path, dtype="float32", max_shard_size=200_000)
    victim = sorted(d.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ValueError) as e:
        load_model(d)
    assert victim.name in str(e.value) and INDEX_FILE in str(e.value)


def test_index_entry_missing_from_shard(tmp_path: Path) -> None:
    d = make_checkpoint(LLAMA, "tiny", tmp_path, dtype="float32", max_shard_size=200_000)
    index = json.loads((d / INDEX_FILE).read_text())
    name = "model.norm.weight"
    shard = d / index["weight_map"][name]
    _rewrite(shard, lambda t: t.pop(name))
    with pytest.raises(ValueError) as e:
        load_model(d)
    assert name in str(e.value) and shard.name in str(e.value)


def test_dtype_auto_follows_config(tmp_path: Path) -> None:
    d = make_checkpoint(LLAMA, "tiny", tmp_path, dtype="bfloat16")
    model, cfg = load_model(d)  # "auto"
    assert cfg.torch_dtype == "bfloat16"
    weights = model.state_dict()
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    weights32 = load_model(d, dtype="float32")[0].state_dict()
    assert weights32["lm_head.weight"].dtype == torch.float32
    assert torch.equal(weights32["lm_head.weight"], weights["lm_head.weight"].float())


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto") == torch.float32
    assert resolve_dtype("bf16") == torch.bfloat16
    assert resolve_dtype("torch.float16") == torch.float16
    assert resolve_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8")
    with pytest.raises(ValueError):
        resolve_dtype(torch.int32)


def test_meta_free_load_puts_everything_on_device(loaded_tiny) -> None:
    model, _ = loaded_tiny(LLAMA)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
