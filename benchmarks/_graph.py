"""One CUDA graph of a benchmark's calls: what a captured decode step pays for a kernel,
without the host's launch overhead. Shared by the kernel benchmarks, which time its
``replay`` with their own timer and divide by the number of calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def capture_calls(calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` in order. Each distinct call runs once first on a side
    stream, so compiling and settling allocations stay out of the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in dict.fromkeys(calls):
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return graph
