"""Attention backends by name (``--attention-backend``)."""

from __future__ import annotations

from pdserve.layers.attention.backend import AttentionBackend

BACKENDS = ("torch", "triton")


def get_attn_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from pdserve.layers.attention.torch_ref import TorchReferenceBackend

        return TorchReferenceBackend()
    if name == "triton":
        from pdserve.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
