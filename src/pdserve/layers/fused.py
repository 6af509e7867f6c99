"""Whether layers use the fused Triton kernels (``pdserve.kernels``) or plain torch ops.

``PDSERVE_FUSED_KERNELS``: ``auto`` (default) uses them for CUDA tensors; ``0`` never;
``1`` always, which on a CPU needs ``TRITON_INTERPRET=1`` (tests run the kernels through
the model that way). The torch path is the reference the kernels are tested against.
Decided once per layer at construction, from the device the model is built on.

A process that uses the kernels releases, at exit, the compiled kernels its Triton
functions cache and collects garbage (:func:`release_triton_at_exit`): a Triton built
with nanobind (the CUDA wheels' since they moved to it) reports every binding object
still alive when the interpreter tears its module down as "leaked" (instances, types and
all of the module's functions, hundreds of lines), and what a compile leaves in a cache
or in a reference cycle is alive then unless it was dropped before.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys

import torch

_release_registered = False


def release_triton_at_exit() -> None:
    """Register :func:`release_triton` to run at exit (once per process)."""
    global _release_registered
    if not _release_registered:
        _release_registered = True
        atexit.register(release_triton)


def release_triton() -> int:
    """Clear the per-device kernel caches of pdserve's Triton functions and collect
    garbage; returns how many functions had caches. Launching a kernel afterwards
    compiles it again (or takes it from Triton's disk cache)."""
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:
        return 0
    cleared = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("pdserve.kernels.") or module is None:
            continue
        for obj in list(vars(module).values()):
            # an autotuner or heuristics wraps the function (its .fn)
            fn = obj if isinstance(obj, jit.JITFunction) else getattr(obj, "fn", None)
            caches = fn.device_caches if isinstance(fn, jit.JITFunction) else None
            if caches:
                caches.clear()
                cleared += 1
    gc.collect()
    return cleared


def use_fused_kernels(device: torch.device | str | None = None) -> bool:
    mode = os.environ.get("PDSERVE_FUSED_KERNELS", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"PDSERVE_FUSED_KERNELS must be auto, 0 or 1 (got {mode!r})")
    if mode == "0":
        return False
    dev = torch.device(device) if device is not None else torch.get_default_device()
    if mode == "1":
        on = dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    elif dev.type != "cuda":
        return False
    else:
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        on = True
    if on:
        release_triton_at_exit()
    return on
