"""Models: HF config parsing, the architecture registry, the safetensors loader, families.

Model families (``llama.py`` …) are imported lazily by the registry.
"""

from pdserve.models.hf_config import HFModelConfig, load_hf_config
from pdserve.models.loader import load_model
from pdserve.models.registry import CausalLM, get_model_class, supported_architectures

__all__ = [
    "CausalLM",
    "HFModelConfig",
    "get_model_class",
    "load_hf_config",
    "load_model",
    "supported_architectures",
]
