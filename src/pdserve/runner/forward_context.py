"""The forward context: per-step data that model code reads without taking it as arguments.

Lifecycle: the model runner builds the attention metadata for one step, enters
``set_forward_context(...)`` around the model's forward, and leaves it when the
forward returns. Exactly one context is active at a time (nesting is refused).
Model code takes only token inputs (ids, positions); attention layers fetch their
KV cache and metadata from here by layer index.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardContext:
    """What one forward pass needs besides its token inputs.

    ``kv_caches[i]`` is layer ``i``'s cache tensor (layout owned by the attention
    backend); ``attn_metadata`` is the backend's metadata object for this step;
    ``attn_backend`` is the backend instance that interprets both.
    """

    attn_backend: Any
    attn_metadata: Any
    kv_caches: list[torch.Tensor]


_CTX: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "pdserve_forward_context", default=None
)


@contextlib.contextmanager
def set_forward_context(
    attn_backend: Any, attn_metadata: Any, kv_caches: list[torch.Tensor]
) -> Iterator[None]:
    if _CTX.get() is not None:
        raise RuntimeError("a forward context is already active; contexts do not nest")
    token = _CTX.set(ForwardContext(attn_backend, attn_metadata, kv_caches))
    try:
        yield
    finally:
        _CTX.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CTX.get()
    if ctx is None:
        raise RuntimeError("no forward context is active: run the model through the model runner")
    return ctx
