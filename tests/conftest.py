"""Shared fixtures: tiny random checkpoints made once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdserve.core_types.pd_auth import SECRET_ENV, new_secret

# One P/D secret for the whole session (set at import, so every child process a test
# starts inherits it), as `pdserve launch` gives one to a topology.
os.environ.setdefault(SECRET_ENV, new_secret())

ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _tiny_checkpoints(
    factory: pytest.TempPathFactory, archs: tuple[str, ...], seed: int
) -> dict[str, Path]:
    from pdserve.testing.checkpoint import make_checkpoint

    out = {}
    for arch in archs:
        d = factory.mktemp(arch)
        make_checkpoint(arch, "tiny", d, seed=seed, dtype="float32")
        out[arch] = d
    return out


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """float32 tiny checkpoints of each architecture, keyed by architecture name."""
    return _tiny_checkpoints(tmp_path_factory, ARCHS, seed=1)


@pytest.fixture(scope="session")
def tiny_llama(tiny_ckpts: dict[str, Path]) -> Path:
    return tiny_ckpts["LlamaForCausalLM"]


DEEPSEEK_ARCHS = ("GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM")


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """float32 tiny checkpoints of the GLM-5 / DeepSeek family (MTP layer included)."""
    return _tiny_checkpoints(tmp_path_factory, DEEPSEEK_ARCHS, seed=2)


@pytest.fixture(scope="session")
def tiny_glm5(tiny_deepseek: dict[str, Path]) -> Path:
    return tiny_deepseek["GlmMoeDsaForCausalLM"]


# Shapes whose tensor-parallel splits at TP=2 are whole 128x128 FP8 blocks: every
# column-parallel part and every row-parallel input gives each rank a multiple of 128.
TP_ALIGNED_LLAMA = dict(
    hidden_size=256,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=256,
)
# GLM-5: q_b_proj 4 x (48 + 16), o_proj 4 x 64, dense MLP 512, experts and shared 256;
# kv_b_proj (4 x (48 + 64), 224 a rank) is dequantized at load and may cut blocks
TP_ALIGNED_GLM5 = dict(
    qk_nope_head_dim=48, v_head_dim=64, intermediate_size=512, moe_intermediate_size=256
)


def _plain_and_fp8(
    factory: pytest.TempPathFactory, arch: str, seed: int, overrides: dict[str, int]
) -> tuple[Path, Path]:
    from pdserve.testing.checkpoint import make_checkpoint

    return (
        make_checkpoint(
            arch, "tiny", factory.mktemp(arch), seed, "float32", config_overrides=overrides
        ),
        make_checkpoint(
            arch,
            "tiny",
            factory.mktemp(f"{arch}-fp8"),
            seed,
            "float32",
            config_overrides=overrides,
            quantization="fp8",
        ),
    )


@pytest.fixture(scope="session")
def tp_fp8_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(float32, FP8) Llama checkpoints of the same values, whose splits at TP=2 keep whole
    FP8 blocks."""
    return _plain_and_fp8(tmp_path_factory, "LlamaForCausalLM", 1, TP_ALIGNED_LLAMA)


@pytest.fixture(scope="session")
def tp_fp8_glm5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(float32, FP8) GLM-5 checkpoints (MTP layer included) of the same values, whose
    splits at TP=2 keep whole FP8 blocks."""
    return _plain_and_fp8(tmp_path_factory, "GlmMoeDsaForCausalLM", 2, TP_ALIGNED_GLM5)
