"""Models: HF config parsing, the architecture registry, the safetensors loader, families.

Exports resolve lazily, so importing the package (or one submodule, such as
``hf_config``) imports none of the other submodules; model families (``llama.py`` …) are imported
by the registry only when a checkpoint names them. Random checkpoints of these
models are written by :mod:`pdserve.testing.checkpoint`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.models.hf_config import HFModelConfig, load_hf_config
    from pdserve.models.loader import load_model
    from pdserve.models.registry import CausalLM, get_model_class, supported_architectures

_EXPORTS = {
    "CausalLM": "pdserve.models.registry",
    "HFModelConfig": "pdserve.models.hf_config",
    "get_model_class": "pdserve.models.registry",
    "load_hf_config": "pdserve.models.hf_config",
    "load_model": "pdserve.models.loader",
    "supported_architectures": "pdserve.models.registry",
}

__all__ = [
    "CausalLM",
    "HFModelConfig",
    "get_model_class",
    "load_hf_config",
    "load_model",
    "supported_architectures",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pdserve.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
