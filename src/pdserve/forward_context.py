"""The per-step context layers read, and the KV caches they own.

Lifecycle: the model runner builds one attention-metadata object per cache group for
a step, enters ``set_forward_context(...)`` around the model's forward, and leaves it
when the forward returns. Exactly one context is active at a time (nesting is
refused). Model code takes only token inputs (ids, positions); a layer that owns a
cache fetches its tensor by its layer name, and the metadata and backend of its group,
from here.

:class:`KVCaches` holds every layer's cache tensor, keyed by group and layer name,
each in the layout its layer declared (:class:`~pdserve.core_types.cache_spec.CacheLayout`).
The runner allocates it once; warm-up, graphs, the compatibility handshake and the KV
connector all read it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.core_types.cache_spec import CacheLayout, KVCacheConfig, KVCacheGroupSpec


class CacheOwner(Protocol):
    """A module that keeps per-token state in the paged KV cache.

    ``layer_name`` is set by the runner (the module's path in the model) before the
    first forward; ``cache_group`` names the group whose metadata and backend it uses.
    """

    layer_name: str
    cache_group: str

    def kv_cache_layout(self, block_size: int, dtype: str) -> CacheLayout | None:
        """This layer's cache (``dtype`` is the engine's default KV dtype), or None when
        it owns none."""
        ...

    def make_backend(self, choice: str, device: torch.device, max_model_len: int) -> Any:
        """The attention backend for this layer's group (``choice``: --attention-backend)."""
        ...


def is_cache_owner(module: object) -> bool:
    return hasattr(module, "kv_cache_layout") and hasattr(module, "cache_group")


class KVCaches:
    """Every cache tensor, by group and layer name, all over the same ``num_blocks``."""

    def __init__(
        self, config: KVCacheConfig, num_blocks: int, tensors: dict[str, torch.Tensor]
    ) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self._tensors = tensors
        self._group_of = {n: g for g in config.groups for n in g.layer_names}

    @classmethod
    def allocate(cls, config: KVCacheConfig, num_blocks: int, device: torch.device) -> KVCaches:
        tensors = {
            name: torch.zeros(
                g.layout.shape(num_blocks), dtype=getattr(torch, g.layout.dtype), device=device
            )
            for g in config.groups
            for name in g.layer_names
        }
        return cls(config, num_blocks, tensors)

    def __getitem__(self, layer_name: str) -> torch.Tensor:
        return self._tensors[layer_name]

    def __len__(self) -> int:
        return len(self._tensors)

    def group_of(self, layer_name: str) -> KVCacheGroupSpec:
        return self._group_of[layer_name]

    def layers(self) -> Iterator[tuple[str, CacheLayout, torch.Tensor]]:
        """(layer name, layout, tensor) of every layer, groups in order: the order every
        transport iterates, on both ends of a transfer. Transports move bytes, so an fp8
        cache comes as its uint8 view (the same storage): index ops on fp8 tensors are
        not implemented everywhere (CPU ``index_copy_``)."""
        for g in self.config.groups:
            for name in g.layer_names:
                t = self._tensors[name]
                yield name, g.layout, t.view(torch.uint8) if t.element_size() == 1 else t

    @property
    def device(self) -> torch.device:
        return next(iter(self._tensors.values())).device if self._tensors else torch.device("cpu")

    def bytes_per_block(self) -> int:
        return self.config.bytes_per_block


@dataclass
class ForwardContext:
    """What one forward pass needs besides its token inputs: per cache group, the
    backend and this step's metadata for it; and the caches."""

    backends: dict[str, Any]
    attn_metadata: dict[str, Any]
    kv_caches: KVCaches


_CTX: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "pdserve_forward_context", default=None
)


@contextlib.contextmanager
def set_forward_context(
    backends: dict[str, Any], attn_metadata: dict[str, Any], kv_caches: KVCaches
) -> Iterator[None]:
    if _CTX.get() is not None:
        raise RuntimeError("a forward context is already active; contexts do not nest")
    token = _CTX.set(ForwardContext(backends, attn_metadata, kv_caches))
    try:
        yield
    finally:
        _CTX.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CTX.get()
    if ctx is None:
        raise RuntimeError("no forward context is active: run the model through the model runner")
    return ctx
