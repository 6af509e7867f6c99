"""Whether layers use the fused Triton kernels (``pdserve.kernels``) or plain torch ops.

``PDSERVE_FUSED_KERNELS``: ``auto`` (default) uses them for CUDA tensors; ``0`` never;
``1`` always, which on a CPU needs ``TRITON_INTERPRET=1`` (tests run the kernels through
the model that way). The torch path is the reference the kernels are tested against.
Decided once per layer at construction, from the device the model is built on.
"""

from __future__ import annotations

import os

import torch


def use_fused_kernels(device: torch.device | str | None = None) -> bool:
    mode = os.environ.get("PDSERVE_FUSED_KERNELS", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"PDSERVE_FUSED_KERNELS must be auto, 0 or 1 (got {mode!r})")
    if mode == "0":
        return False
    dev = torch.device(device) if device is not None else torch.get_default_device()
    if mode == "1":
        return dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if dev.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
