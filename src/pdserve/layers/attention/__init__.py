"""Attention: the backend interface, the backends, and the model-facing layer."""

from pdserve.layers.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    GQABackend,
)
from pdserve.layers.attention.layer import Attention
from pdserve.layers.attention.registry import gqa_backend

__all__ = ["Attention", "AttentionBackend", "CommonAttentionMetadata", "GQABackend", "gqa_backend"]
