"""Open-loop arrival schedule, as ``vllm bench serve`` computes it.

* ``request_rate == inf``: every request is due at t = 0.
* ``burstiness == inf``: constant gaps ``1/R``.
* otherwise gaps ~ Gamma(shape=burstiness, scale=1/(R*burstiness)) (mean 1/R,
  coefficient of variation 1/sqrt(burstiness); burstiness 1 is Poisson), drawn
  from the legacy ``numpy`` global-RNG stream seeded with ``seed`` (the same
  numbers vLLM's ``np.random.seed(seed); np.random.gamma(...)`` gives).

The cumulative delays are then rescaled so the last request is due at exactly
``N/R``. The first request is due after the first gap, not at 0.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import numpy as np

from pdserve.bench.errors import BenchError

T = TypeVar("T")


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Due times in seconds after dispatch start, non-decreasing, shape ``(num_requests,)``."""
    if num_requests < 1:
        raise BenchError(f"need at least one request, got {num_requests}")
    if not request_rate > 0:
        raise BenchError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(num_requests, dtype=np.float64)
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate, dtype=np.float64)
    else:
        theta = 1.0 / (request_rate * burstiness)
        gaps = np.random.RandomState(seed).gamma(shape=burstiness, scale=theta, size=num_requests)
    delays = np.cumsum(gaps, dtype=np.float64)
    if delays[-1] != 0:
        delays = delays * ((num_requests / request_rate) / delays[-1])
    return np.asarray(delays, dtype=np.float64)


async def paced(items: Sequence[T], offsets: Sequence[float]) -> AsyncIterator[T]:
    """Yield ``items[i]`` no earlier than ``offsets[i]`` seconds after the first ``anext``.

    Sleeps against absolute deadlines, so slow consumers do not accumulate drift.
    """
    if len(items) != len(offsets):
        raise ValueError("items and offsets differ in length")
    start = time.perf_counter()
    for item, due in zip(items, offsets, strict=True):
        if due > 0:
            wait = start + float(due) - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
        yield item
