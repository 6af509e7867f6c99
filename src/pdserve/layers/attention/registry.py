"""GQA attention backends by name (``--attention-backend``)."""

from __future__ import annotations

import torch

from pdserve.layers.attention.backend import GQABackend

BACKENDS = ("auto", "torch", "triton")


def gqa_backend(
    name: str, device: torch.device | None = None, max_model_len: int | None = None
) -> GQABackend:
    """``auto`` is triton on CUDA and torch (the reference) elsewhere."""
    if name == "auto":
        name = "triton" if device is not None and device.type == "cuda" else "torch"
    if name == "torch":
        from pdserve.layers.attention.torch_ref import TorchReferenceBackend

        return TorchReferenceBackend()
    if name == "triton":
        from pdserve.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(max_model_len=max_model_len)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
