"""config.json parsing: defaults, both RoPE spellings, and errors that name the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.models import get_model_class, load_hf_config, supported_architectures
from pdserve.models.hf_config import HFModelConfig

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 100,
}


def _parse(**changes: Any) -> HFModelConfig:
    d = {**BASE, **changes}
    return HFModelConfig.from_dict({k: v for k, v in d.items() if v is not ...}, "x/config.json")


def test_defaults() -> None:
    c = _parse()
    assert c.num_key_value_heads == 4 and c.head_dim == 16
    assert c.rope_theta == 10000.0 and c.rope_scaling is None
    assert not c.tie_word_embeddings and c.torch_dtype is None and c.eos_token_ids == ()
    assert c.architecture == "LlamaForCausalLM"


def test_classic_llama3_rope_and_dtype() -> None:
    c = _parse(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        torch_dtype="bfloat16",
        eos_token_id=[1, 2],
        head_dim=32,
    )
    assert c.rope_theta == 500000.0 and c.head_dim == 32
    assert c.rope_scaling is not None and c.rope_scaling.rope_type == "llama3"
    assert c.rope_scaling.original_max_position_embeddings == 8192
    assert c.torch_dtype == "bfloat16" and c.eos_token_ids == (1, 2)


def test_transformers5_rope_parameters_and_dtype_key() -> None:
    c = _parse(
        rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}, dtype="float16"
    )
    assert c.rope_theta == 1e6 and c.rope_scaling is not None and c.rope_scaling.factor == 2.0
    assert c.torch_dtype == "float16"
    c = _parse(rope_parameters={"rope_type": "default", "rope_theta": 7.0})
    assert c.rope_theta == 7.0 and c.rope_scaling is None


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"hidden_size": ...}, "hidden_size"),
        ({"architectures": ...}, "architectures"),
        ({"architectures": []}, "architectures"),
        ({"vocab_size": -3}, "vocab_size"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarnish", "factor": 2.0}}, "yarnish"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"eos_token_id": "x"}, "eos_token_id"),
    ],
)
def test_errors_name_the_key(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as e:
        _parse(**changes)
    assert needle in str(e.value) and "x/config.json" in str(e.value)


def test_load_from_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert load_hf_config(tmp_path).path == tmp_path / "config.json"


def test_registry() -> None:
    assert supported_architectures() == [
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLM",
        "GlmMoeDsaForCausalLM",
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
    ]
    assert get_model_class(_parse()).__name__ == "LlamaForCausalLM"
    assert (
        get_model_class(_parse(architectures=["Qwen3ForCausalLM"])).__name__ == "Qwen3ForCausalLM"
    )
    with pytest.raises(ValueError) as e:
        get_model_class(_parse(architectures=["MixtralForCausalLM"]))
    assert "MixtralForCausalLM" in str(e.value) and "x/config.json" in str(e.value)
