"""Attention: the backend interface, the backends, and the model-facing layer."""

from pdserve.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from pdserve.layers.attention.layer import Attention
from pdserve.layers.attention.registry import get_attn_backend

__all__ = ["Attention", "AttentionBackend", "CommonAttentionMetadata", "get_attn_backend"]
