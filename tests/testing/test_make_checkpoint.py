"""make_checkpoint writes exact HF format, deterministically; the CLI entry wraps it."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

from pdserve.layers.linear import Linear
from pdserve.models import HFModelConfig, get_model_class, load_hf_config, load_model, registry
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.random_init import DEFAULT_INIT, INIT_STD, NORM_NOISE, init_rule
from pdserve.testing.checkpoint import (
    add_cli_args,
    build_config,
    build_tokenizer,
    checkpoint_tensors,
    main,
    make_checkpoint,
    parse_size,
)

ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
}


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_files_and_config(tiny_ckpts: dict[str, Path]) -> None:
    for arch, d in tiny_ckpts.items():
        assert {p.name for p in d.iterdir()} == FILES
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == [arch] and cfg["torch_dtype"] == "float32"
        tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
        assert tok_cfg["chat_template"] and tok_cfg["eos_token"]
    llama = json.loads((tiny_ckpts["LlamaForCausalLM"] / "config.json").read_text())
    qwen = json.loads((tiny_ckpts["Qwen3ForCausalLM"] / "config.json").read_text())
    assert llama["model_type"] == "llama" and not llama["tie_word_embeddings"]
    assert llama["rope_scaling"]["rope_type"] == "llama3"
    assert qwen["model_type"] == "qwen3" and qwen["tie_word_embeddings"]


def test_deterministic_per_seed(tmp_path: Path) -> None:
    a = make_checkpoint("Qwen3ForCausalLM", "tiny", tmp_path / "a", seed=7)
    b = make_checkpoint("Qwen3ForCausalLM", "tiny", tmp_path / "b", seed=7)
    c = make_checkpoint("Qwen3ForCausalLM", "tiny", tmp_path / "c", seed=8)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]
    assert _digest(a)["tokenizer.json"] == _digest(c)["tokenizer.json"]


def test_rewrite_in_place_drops_stale_shards(tmp_path: Path) -> None:
    make_checkpoint("LlamaForCausalLM", "tiny", tmp_path, max_shard_size=100_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    make_checkpoint("LlamaForCausalLM", "tiny", tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == FILES


def test_llama_8b_shape_dimensions() -> None:
    tok = build_tokenizer("LlamaForCausalLM")
    cfg = build_config("LlamaForCausalLM", "llama-8b-shape", tok, "bfloat16")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (
        4096,
        32,
        32,
    )
    assert (cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"]) == (
        8,
        14336,
        128256,
    )
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["factor"] == 8.0
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 8192
    specs = checkpoint_tensors(cfg, "bfloat16")  # built on meta: nothing allocated
    assert sum(_numel(shape) for shape, _ in specs.values()) == 8_030_261_248  # Llama-3-8B
    assert {dtype for _, dtype in specs.values()} == {torch.bfloat16}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"arch": "GPT2LMHeadModel"}, "GPT2LMHeadModel"),
        ({"preset": "huge"}, "huge"),
        ({"dtype": "int8"}, "int8"),
        ({"seed": -1}, "seed"),
        ({"device": "nonsense"}, "nonsense"),
    ],
)
def test_invalid_arguments(tmp_path: Path, kwargs: dict, needle: str) -> None:
    args = {"arch": "LlamaForCausalLM", "preset": "tiny", "out_dir": tmp_path, **kwargs}
    with pytest.raises(ValueError, match=needle):
        make_checkpoint(**args)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    out = tmp_path / "cli"
    argv = ["--arch", "Qwen3ForCausalLM", "--preset", "tiny", "--out", str(out), "--seed", "4"]
    assert main(parser.parse_args([*argv, "--max-shard-size", "100KB"])) == 0
    assert (out / "model.safetensors.index.json").exists()
    assert "wrote Qwen3ForCausalLM" in capsys.readouterr().out
    assert main(parser.parse_args([*argv, "--max-shard-size", "lots"])) == 2
    assert "cannot parse size" in capsys.readouterr().err


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("123") == 123
    with pytest.raises(ValueError):
        parse_size("0MB")


# ----------------------------------------------------- shapes come from the model
def _file_tensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in ``d`` (single file or shards)."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(d.glob("model*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                assert name not in out, f"{name} in two shards"
                out[name] = f.get_tensor(name)
    return out


def _meta_specs(d: Path, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """checkpoint_tensors() of the model of ``d``'s config.json, built on the meta device."""
    cfg = load_hf_config(d)
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg, dtype)
    specs = model.checkpoint_tensors()
    assert set(specs) == model.checkpoint_tensor_names()
    return specs


@pytest.mark.parametrize("arch", ARCHS)
def test_written_tensors_are_the_models(tmp_path: Path, arch: str) -> None:
    d = make_checkpoint(arch, "tiny", tmp_path, seed=2, dtype="bfloat16", max_shard_size=60_000)
    assert (d / "model.safetensors.index.json").exists()
    written = _file_tensors(d)
    specs = _meta_specs(d, torch.bfloat16)
    assert {n: (tuple(t.shape), t.dtype) for n, t in written.items()} == specs
    model, _ = load_model(d)
    state = model.state_dict()
    assert torch.equal(state["model.embed_tokens.weight"], written["model.embed_tokens.weight"])
    assert torch.equal(state["model.norm.weight"], written["model.norm.weight"])


def test_sharded_and_single_file_hold_identical_tensors(tmp_path: Path) -> None:
    single = make_checkpoint("Qwen3ForCausalLM", "tiny", tmp_path / "single", seed=9)
    sharded = make_checkpoint(
        "Qwen3ForCausalLM", "tiny", tmp_path / "sharded", seed=9, max_shard_size=30_000
    )
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2
    a, b = _file_tensors(single), _file_tensors(sharded)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in a.values())


def test_init_table() -> None:
    assert init_rule("model.norm.weight") == (1.0, NORM_NOISE)
    assert init_rule("model.layers.3.self_attn.q_norm.weight") == (1.0, NORM_NOISE)
    assert init_rule("model.layers.3.mlp.gate.e_score_correction_bias") == (0.0, INIT_STD)
    assert init_rule("model.layers.3.mlp.gate.weight") == DEFAULT_INIT
    assert init_rule("lm_head.weight") == DEFAULT_INIT == (0.0, INIT_STD)


N_EXPERTS = 16
ROUTED = "RoutedLlamaForCausalLM"


class _RoutedLlama(LlamaForCausalLM):
    """Test-only family: Llama plus, per layer, an MoE-style router kept in float32."""

    def __init__(self, config: HFModelConfig, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(config, dtype)
        for layer in self.model.layers:
            gate = Linear(config.hidden_size, N_EXPERTS, dtype=torch.float32)
            gate.e_score_correction_bias = nn.Parameter(
                torch.empty(N_EXPERTS, dtype=torch.float32), requires_grad=False
            )
            layer.mlp.gate = gate


def test_float32_tensors_stay_float32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._MODELS, ROUTED, (__name__, _RoutedLlama.__name__))
    d = make_checkpoint(
        "LlamaForCausalLM",
        "tiny",
        tmp_path,
        seed=4,
        dtype="bfloat16",
        max_shard_size=50_000,
        config_overrides={"architectures": [ROUTED]},
    )
    written = _file_tensors(d)
    specs = _meta_specs(d, torch.bfloat16)
    assert {n: (tuple(t.shape), t.dtype) for n, t in written.items()} == specs
    router = {n for n in written if ".mlp.gate." in n}
    assert router == {
        f"model.layers.{i}.mlp.gate.{p}"
        for i in range(2)
        for p in ("weight", "e_score_correction_bias")
    }
    assert all(written[n].dtype == torch.float32 for n in router)
    assert {t.dtype for n, t in written.items() if n not in router} == {torch.bfloat16}
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in written.values())
    # init table: the routing bias is random (HF would write zeros), norms are near 1
    bias = written["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0 and 0.005 < bias.std() < 0.05
    assert abs(written["model.norm.weight"].float().mean() - 1.0) < 0.05
    model, _ = load_model(d)
    gate = model.state_dict()["model.layers.1.mlp.gate.weight"]
    assert gate.dtype == torch.float32 and torch.equal(
        gate, written["model.layers.1.mlp.gate.weight"]
    )


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "GlmMoeDsaForCausalLM"])
def test_dummy_load_format_draws_the_checkpoints_values(arch: str, tmp_path: Path) -> None:
    """--load-format dummy from a config-only folder gives, tensor for tensor, the model
    make-checkpoint writes with the same seed (MTP layers drawn in order, built or not)."""
    from pdserve.models import load_model

    full = make_checkpoint(arch, "tiny", tmp_path / "full", seed=3, dtype="float32")
    bare = make_checkpoint(
        arch, "tiny", tmp_path / "bare", seed=3, dtype="float32", config_only=True
    )
    assert not list(bare.glob("*.safetensors")) and (bare / "tokenizer.json").is_file()
    loaded, _ = load_model(full, "float32")
    dummy, _ = load_model(bare, "float32", load_format="dummy", seed=3)
    want = dict(loaded.named_parameters())
    for name, p in dummy.named_parameters():
        assert torch.equal(p, want[name]), name


def test_benchmark_sizes_get_the_models_full_vocabulary(tmp_path: Path, tiny_llama: Path) -> None:
    """Above SMALL_VOCAB the tokenizer has exactly the model's vocabulary, special tokens
    last, so vLLM-style random prompts do not repeat (each block of ids is distinct)."""
    from transformers import AutoTokenizer

    from pdserve.bench.datasets import sample_random_requests
    from pdserve.testing.tokenizer_maker import SMALL_VOCAB

    vocab = 2 * SMALL_VOCAB
    d = make_checkpoint(
        "LlamaForCausalLM",
        "tiny",
        tmp_path,
        config_only=True,
        config_overrides={"vocab_size": vocab},
    )
    tok = AutoTokenizer.from_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"] == vocab
    assert cfg["bos_token_id"] == tok.bos_token_id >= vocab - 300  # special tokens last
    assert (
        make_checkpoint(  # deterministic
            "LlamaForCausalLM",
            "tiny",
            tmp_path / "again",
            config_only=True,
            config_overrides={"vocab_size": vocab},
        )
        .joinpath("tokenizer.json")
        .read_bytes()
        == (d / "tokenizer.json").read_bytes()
    )

    def distinct_first_blocks(t: Any) -> int:
        reqs = sample_random_requests(t, 200, input_len=64, output_len=4, seed=0)
        return len({tuple(t.encode(r.prompt, add_special_tokens=False)[:16]) for r in reqs})

    small = distinct_first_blocks(AutoTokenizer.from_pretrained(tiny_llama))  # 512 tokens
    full = distinct_first_blocks(tok)
    print(f"distinct first blocks of 200 prompts: {small} (512 tokens), {full} ({vocab})")
    assert full >= 190 and small < full - 50
