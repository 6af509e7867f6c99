"""Where the engine runs and how much KV cache fits there."""

from __future__ import annotations

import torch

CPU_DEFAULT_KV_BYTES = 256 << 20

# What this process may hold on the GPU outside torch's caching allocator after start-up
# (cuBLAS handles, loaded Triton modules, graph executables): the CUDA context itself is
# already there when the start-up free memory is read.
NON_TORCH_ALLOWANCE = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for but no CUDA GPU is available")
    return dev


def kv_budget_bytes(
    total: int, free: int, free_at_start: int, reserved: int, utilization: float
) -> tuple[int, int]:
    """(KV cache bytes, this process's bytes) for ``gpu_memory_utilization``.

    This process's share is the drop in free memory since start-up, capped by what its
    allocator reserved plus :data:`NON_TORCH_ALLOWANCE`: instances sharing a GPU start
    together, and the drop alone would charge a neighbour's weights loaded meanwhile to
    this one (a prefill instance once got 3.5 GiB of KV instead of 40 for that reason).
    The KV cache must also fit in what is free now, less 2% slack for graphs, the
    sampler and allocator rounding.
    """
    ours = min(free_at_start - free, reserved + NON_TORCH_ALLOWANCE)
    budget = int(total * utilization) - ours
    headroom = int(0.02 * total)
    return min(budget, free - headroom), ours
