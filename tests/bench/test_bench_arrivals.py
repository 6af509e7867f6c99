"""Arrival schedule: rate, rescaling, burstiness, and vLLM's RNG stream."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets, paced
from pdserve.bench.errors import BenchError


def _gaps(t: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], t]))


def test_infinite_rate_all_at_zero() -> None:
    t = arrival_offsets(50, float("inf"), 1.0, seed=3)
    assert t.shape == (50,) and not t.any()


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.25])
def test_rate_rescale_and_cv(burstiness: float) -> None:
    n, rate = 4000, 8.0
    t = arrival_offsets(n, rate, burstiness, seed=0)
    assert t[-1] == pytest.approx(n / rate, rel=1e-12)  # last arrival exactly N/R
    assert np.all(np.diff(t) >= 0)
    gaps = _gaps(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / np.sqrt(burstiness), rel=0.08)


def test_infinite_burstiness_is_constant() -> None:
    t = arrival_offsets(10, 5.0, float("inf"))
    assert np.allclose(_gaps(t), 0.2)
    assert t[-1] == pytest.approx(2.0)


def test_matches_vllm_global_numpy_stream() -> None:
    n, rate, b, seed = 100, 3.0, 0.7, 42
    np.random.seed(seed)
    delays = np.cumsum([np.random.gamma(shape=b, scale=1 / (rate * b)) for _ in range(n)])
    expected = delays * ((n / rate) / delays[-1])
    assert np.allclose(arrival_offsets(n, rate, b, seed=seed), expected, rtol=0, atol=1e-12)


def test_seeded() -> None:
    a = arrival_offsets(20, 2.0, 1.0, seed=1)
    assert np.array_equal(a, arrival_offsets(20, 2.0, 1.0, seed=1))
    assert not np.array_equal(a, arrival_offsets(20, 2.0, 1.0, seed=2))


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_rejects_bad_values(rate: float, burst: float) -> None:
    with pytest.raises(BenchError):
        arrival_offsets(5, rate, burst)


def test_paced_honours_due_times() -> None:
    async def go() -> list[float]:
        start = time.perf_counter()
        seen = []
        async for _ in paced(["a", "b", "c"], [0.0, 0.05, 0.1]):
            seen.append(time.perf_counter() - start)
        return seen

    seen = asyncio.run(go())
    assert seen[0] < 0.03
    assert 0.05 <= seen[1] < 0.09
    assert 0.1 <= seen[2] < 0.14
