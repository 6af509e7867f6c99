"""The capacity search of ``bench sla``: bracket by doubling, then bisect.

``search(measure, ...)`` knows nothing about HTTP: ``measure(x)`` runs one point at load
``x`` (a request rate, or a concurrency) and says whether it met the SLA. The search

1. measures ``start``; while it passes, doubles ``x`` (up to ``max_value``); while it
   fails, halves ``x`` (down to ``min_value``). That gives ``lo`` (passes) < ``hi``
   (fails), or the answer that even ``min_value`` fails (capacity ``None``), or that
   ``max_value`` still passes (capacity ``max_value``, ``bounded`` True);
2. bisects ``[lo, hi]`` until ``(hi - lo) / lo <= tolerance`` (for integer loads also
   until ``hi - lo <= 1``); the capacity is the last ``lo``.

A point is never measured twice (a repeated ``x`` reuses the first result). Real
servers are noisy and not exactly monotone; the search trusts each point as measured.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

SLA_METRICS = ("mean", "p50", "p90", "p99")
MIN_ACHIEVED = 0.95  # a point fails below this fraction of the offered request rate


@dataclass(frozen=True)
class SLA:
    """Thresholds in ms on one statistic (``mean`` or ``pNN``) of TTFT and TPOT."""

    ttft_ms: float = 2500.0
    tpot_ms: float = 20.0
    metric: str = "mean"

    def key(self, name: str) -> str:
        """The ``bench serve`` result key of the statistic, e.g. ``mean_ttft_ms``."""
        return f"{self.metric}_{name}_ms"

    def check(self, result: dict[str, Any]) -> tuple[bool, str]:
        """``(passed, why)`` for one ``bench serve`` result; any failed request fails it,
        and so does a server that completed requests at under :data:`MIN_ACHIEVED` of
        the rate they arrived at (it did not keep up: its queue grew all run long)."""
        if not result.get("completed"):
            return False, "no request succeeded"
        if result.get("failed"):
            return False, f"{result['failed']} requests failed"
        ttft = _num(result.get(self.key("ttft")))
        tpot = _num(result.get(self.key("tpot")))
        reasons = []
        offered, achieved = result.get("offered_request_rate"), result.get("achieved_request_rate")
        if offered and achieved is not None and achieved < MIN_ACHIEVED * offered:
            reasons.append(
                f"achieved {achieved:.2f} req/s < {MIN_ACHIEVED:.0%} of the offered "
                f"{offered:.2f} req/s"
            )
        if ttft > self.ttft_ms:
            reasons.append(f"{self.metric} TTFT {ttft:.1f} ms > {self.ttft_ms:g}")
        if tpot > self.tpot_ms:
            reasons.append(f"{self.metric} TPOT {tpot:.2f} ms > {self.tpot_ms:g}")
        return (not reasons), "; ".join(reasons) or "meets the SLA"


def _num(value: Any) -> float:
    """A result statistic as a float; a missing one (no samples) counts as 0."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if math.isnan(out) else out


@dataclass
class Point:
    """One measured load: ``x`` and the summary of its ``bench serve`` run."""

    x: float
    passed: bool
    why: str
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class SearchResult:
    points: list[Point]
    capacity: float | None  # the largest passing load found (None: even the least failed)
    bracket: tuple[float | None, float | None]  # final (lo, hi)
    bounded: bool  # True when max_value still passed (the true capacity may be higher)

    def capacity_point(self) -> Point | None:
        if self.capacity is None:
            return None
        return next(p for p in self.points if p.x == self.capacity)


Measure = Callable[[float], Awaitable[Point]]


def _round(x: float, integer: bool) -> float:
    return float(max(1, round(x))) if integer else x


async def search(
    measure: Measure,
    *,
    start: float,
    tolerance: float,
    max_value: float,
    min_value: float,
    integer: bool = False,
    on_point: Callable[[Point], None] | None = None,
) -> SearchResult:
    """See the module docstring. ``integer`` loads (concurrency) are whole numbers >= 1."""
    if not (0 < min_value <= start <= max_value):
        raise ValueError(f"need 0 < min ({min_value}) <= start ({start}) <= max ({max_value})")
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance}")
    seen: dict[float, Point] = {}
    order: list[Point] = []

    async def at(x: float) -> Point:
        x = _round(x, integer)
        if x not in seen:
            p = await measure(x)
            p.x = x
            seen[x] = p
            order.append(p)
            if on_point is not None:
                on_point(p)
        return seen[x]

    lo: float | None = None
    hi: float | None = None
    x = _round(start, integer)
    if (await at(x)).passed:
        lo = x
        while lo < max_value:
            nxt = min(_round(lo * 2, integer), max_value)
            if (await at(nxt)).passed:
                lo = nxt
            else:
                hi = nxt
                break
        if hi is None:
            return SearchResult(order, lo, (lo, None), bounded=True)
    else:
        hi = x
        while hi > min_value:
            nxt = max(_round(hi / 2, integer), min_value)
            if nxt >= hi:
                break
            if (await at(nxt)).passed:
                lo = nxt
                break
            hi = nxt
        if lo is None:
            return SearchResult(order, None, (None, hi), bounded=False)

    while (hi - lo) / lo > tolerance and not (integer and hi - lo <= 1):
        mid = math.floor((lo + hi) / 2) if integer else (lo + hi) / 2
        if (await at(mid)).passed:
            lo = mid
        else:
            hi = mid
    return SearchResult(order, lo, (lo, hi), bounded=False)


def max_points(start: float, tolerance: float, max_value: float, min_value: float) -> int:
    """An upper bound of the number of points ``search`` measures (for a progress bar)."""
    up = math.ceil(math.log2(max(max_value / start, 1.0))) + 1
    down = math.ceil(math.log2(max(start / min_value, 1.0))) + 1
    bisect = math.ceil(math.log2(1.0 / tolerance)) + 1
    return max(up, down) + bisect
