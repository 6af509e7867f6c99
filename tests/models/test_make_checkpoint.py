"""make_checkpoint writes exact HF format, deterministically; the CLI entry wraps it."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from pdserve.models.checkpoint import (
    add_cli_args,
    build_config,
    build_tokenizer,
    main,
    make_checkpoint,
    parse_size,
    weight_shapes,
)

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
    params = sum(_numel(s) for _, s in weight_shapes(cfg))
    assert params == 8_030_261_248  # Llama-3-8B


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
