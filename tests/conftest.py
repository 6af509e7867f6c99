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
