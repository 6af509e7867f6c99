"""Architecture name (``config.json`` ``architectures[0]``) → model class.

Each family lives in its own module and is imported only when asked for, so
adding one (``GlmMoeDsaForCausalLM`` in ``glm_moe_dsa.py``) is one line in
``_MODELS`` plus its file. Every model class subclasses :class:`CausalLM`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from pdserve.layers.linear import Shard, checkpoint_shards, checkpoint_targets
from pdserve.models.hf_config import HFModelConfig

# architecture → (module, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pdserve.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("pdserve.models.llama", "Qwen3ForCausalLM"),
    "DeepseekV3ForCausalLM": ("pdserve.models.glm_moe_dsa", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("pdserve.models.glm_moe_dsa", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("pdserve.models.glm_moe_dsa", "GlmMoeDsaForCausalLM"),
}


class CausalLM(nn.Module, ABC):
    """What the model runner and the loader rely on.

    Lifecycle: constructed (parameters allocated, uninitialised, on the current
    device) → ``load_weights`` fills every tensor named by
    ``checkpoint_tensor_names`` → ``forward`` is called inside a forward context.
    The forward takes a flat batch of tokens and must stay free of host syncs and
    data-dependent Python control flow (it is captured in CUDA graphs).
    """

    # linears the model reads as raw weights, kept in the model dtype under FP8
    # quantization (dequantized at load; see pdserve.models.quantization)
    fp8_dense_modules: tuple[str, ...] = ()
    # the steps that launch dependently (programmatic dependent launch) where PDSERVE_PDL
    # does not say: those of at most this many tokens, None every step, 0 none
    # (pdserve.kernels._utils.use_pdl_by_default, set by ModelStep.hidden)
    pdl_tokens: int | None = None

    def __init__(self, config: HFModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 → final hidden states [T, hidden_size]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] → logits [N, vocab_size] float32."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in; return the names loaded.

        Raises ValueError naming the tensor when a name is unknown or a shape is wrong.
        """

    @abstractmethod
    def checkpoint_tensor_names(self) -> set[str]:
        """The HF tensor names a complete checkpoint provides for this model."""

    def configure_decode(self) -> None:
        """The family's decode-path choices, made by the loader once the layers are final
        (FP8 linears swapped in): nothing by default."""

    def fp8_activation_links(self) -> list[tuple[str, list[str]]]:
        """(producer, every consumer of its output) as module paths, for the producers
        that can emit an FP8 activation (an RMSNorm, SiLU-and-mul): where all the
        consumers are block-FP8 linears after loading, the producer quantizes its output
        for them (:func:`~pdserve.models.quantization.fuse_fp8_activations`). A family
        lists every consumer, the ones that need the bf16 output too (a router, an
        indexer), so those producers stay bf16. None by default."""
        return []

    def is_foreign_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to another rank of the instance (the
        loader skips it: an expert-parallel rank reads only its own experts)."""
        return False

    def checkpoint_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF tensor name → (shape, dtype) of a complete checkpoint, in a fixed order.

        Works on a model built on the meta device: random checkpoints
        (:mod:`pdserve.testing.checkpoint`) are shaped, typed and drawn in this
        order. The default is :func:`~pdserve.layers.linear.checkpoint_targets`
        (named-module order, merged layers as their HF parts, tied tensors once,
        each in the dtype the model keeps it in). A family whose checkpoint layout
        differs from its in-memory one overrides this: experts fused in memory but
        stored per expert, or tensors of a layer it does not build (an MTP layer).
        """
        return {name: (tuple(t.shape), t.dtype) for name, t in checkpoint_targets(self).items()}

    def checkpoint_shards(self) -> dict[str, Shard]:
        """The checkpoint tensors this tensor-parallel rank holds a part of, with the part
        (the loader reads only that slice); the others are whole. Shapes in
        :meth:`checkpoint_tensors` are this rank's. Empty without tensor parallelism."""
        return checkpoint_shards(self)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config: HFModelConfig) -> type[CausalLM]:
    """The class for ``config.architecture``; unknown names are a ValueError naming the file."""
    arch = config.architecture
    entry = _MODELS.get(arch)
    if entry is None:
        raise ValueError(
            f"unsupported architecture {arch!r} in {config.path}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = entry
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, CausalLM)):
        raise TypeError(f"{module_name}.{class_name} is not a CausalLM subclass")
    return cls
