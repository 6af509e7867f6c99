"""The model's forward over the runner's static input buffers.

:class:`ModelStep` is what the model runner, CUDA-graph capture and warm-up share:
the model, the input buffers, one attention backend per cache group, and the KV
caches. It builds each group's metadata from the step's common metadata and runs the
model inside the forward context; nothing in it knows about requests or scheduling.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from pdserve.core_types.cache_spec import KVCacheConfig
from pdserve.forward_context import KVCaches, is_cache_owner, set_forward_context
from pdserve.kernels.reference import FP8_DTYPE
from pdserve.layers.attention import AttentionBackend, CommonAttentionMetadata
from pdserve.layers.attention.kv_scale import FP8CacheScales
from pdserve.models.registry import CausalLM
from pdserve.runner.input_buffers import InputBuffers

logger = logging.getLogger(__name__)
_FP8_NAME = str(FP8_DTYPE).removeprefix("torch.")  # "float8_e4m3fn", as layouts name it


def collect_cache_layers(
    model: nn.Module, block_size: int, kv_dtype: str, fp8_kv_dtype: str | None = None
) -> tuple[KVCacheConfig, dict[str, list[nn.Module]]]:
    """Name every cache-owning module by its path in the model, ask it for its cache,
    and group the answers. Returns the config and each group's layers. With
    ``fp8_kv_dtype`` (``--kv-cache-dtype fp8``) the owners that read an FP8 cache
    (``supports_fp8_cache``: GQA attention, MLA, the DSA indexer, whose fp8 layout
    carries a scale a key) get that dtype; any other keeps ``kv_dtype``. Without it, FP8 KV cache scales the checkpoint gave are
    ignored (as vLLM ignores them with an unquantized cache), which is logged once."""
    entries = []
    layers: dict[str, list[nn.Module]] = {}
    unused_scales = []
    for name, mod in model.named_modules():
        if not is_cache_owner(mod):
            continue
        mod.layer_name = name
        fp8 = fp8_kv_dtype is not None and getattr(mod, "supports_fp8_cache", False)
        if not fp8 and isinstance(mod, FP8CacheScales) and mod.has_kv_scales():
            unused_scales.append(name)
        layout = mod.kv_cache_layout(block_size, fp8_kv_dtype if fp8 else kv_dtype)
        if layout is None:
            continue
        entries.append((name, mod.cache_group, layout))
        layers.setdefault(mod.cache_group, []).append(mod)
    if unused_scales:
        logger.info(
            "the checkpoint's KV cache scales (%d layers, e.g. %s) are ignored: the KV cache "
            "is %s, not fp8 (--kv-cache-dtype fp8 uses them)",
            len(unused_scales),
            unused_scales[0],
            kv_dtype,
        )
    return KVCacheConfig.from_layers(block_size, entries), layers


def kv_cache_scales(
    config: KVCacheConfig, layers: dict[str, list[nn.Module]]
) -> dict[str, list[float]]:
    """Every FP8 cache layer's [k_scale, v_scale], by layer name: what the P/D handshake
    compares (a prefill and a decode instance must write and read the same scales)."""
    fp8 = {g.name for g in config.groups if g.layout.dtype == _FP8_NAME}
    return {
        mod.layer_name: list(mod.kv_scales())
        for group, mods in layers.items()
        if group in fp8
        for mod in mods
        if isinstance(mod, FP8CacheScales)
    }


@dataclass
class ModelStep:
    model: CausalLM
    buffers: InputBuffers
    kv_cache_config: KVCacheConfig
    group_layers: dict[str, list[nn.Module]]  # cache group -> its layers
    backends: dict[str, AttentionBackend]  # cache group -> its backend
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    kv_caches: KVCaches | None = field(default=None)

    @property
    def supports_cuda_graphs(self) -> bool:
        return all(b.supports_cuda_graphs for b in self.backends.values())

    def hidden(
        self, common: CommonAttentionMetadata, kv_caches: KVCaches | None = None
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the ``common.num_actual_tokens`` tokens in
        the input buffers (``kv_caches``: throwaway caches for profiling runs)."""
        caches = kv_caches if kv_caches is not None else self.kv_caches
        assert caches is not None, "the KV cache is not allocated yet"
        from pdserve.kernels._utils import use_pdl_by_default  # Triton: at use (test_layering)

        md = {g: b.build_metadata(common) for g, b in self.backends.items()}
        t = common.num_actual_tokens
        limit = self.model.pdl_tokens  # the family's dependent launches, for this step
        use_pdl_by_default(limit is None or t <= limit)
        with set_forward_context(self.backends, md, caches):
            return self.model(self.buffers.input_ids.dev[:t], self.buffers.positions.dev[:t])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
