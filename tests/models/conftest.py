"""Fixtures of the model tests (the session-wide tiny checkpoints live in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.models import CausalLM, HFModelConfig, load_model


@pytest.fixture(scope="session")
def loaded_tiny(tiny_ckpts: dict[str, Path]) -> Callable[[str], tuple[CausalLM, HFModelConfig]]:
    """float32 pdserve models of the tiny checkpoints, loaded once per architecture."""
    cache: dict[str, tuple[CausalLM, HFModelConfig]] = {}

    def get(arch: str) -> tuple[CausalLM, HFModelConfig]:
        if arch not in cache:
            cache[arch] = load_model(tiny_ckpts[arch], dtype="float32")
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def hf_tiny(tiny_ckpts: dict[str, Path]) -> Callable[[str], torch.nn.Module]:
    """transformers models (float32, eager attention) of the tiny checkpoints."""
    transformers = pytest.importorskip("transformers")
    cache: dict[str, torch.nn.Module] = {}

    def get(arch: str) -> torch.nn.Module:
        if arch not in cache:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_ckpts[arch], dtype=torch.float32, attn_implementation="eager"
            )
            cache[arch] = model.eval()
        return cache[arch]

    return get
