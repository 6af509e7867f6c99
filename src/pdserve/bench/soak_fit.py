"""The leak test of ``soak``: a least-squares line of RSS against completed requests.

For one process, ``x`` = requests completed when a sample was taken and ``y`` = its RSS
in bytes. The slope ``b`` (bytes per request) of the ordinary least-squares line has
standard error ``sqrt(SSE / (n - 2) / Sxx)``; its two-sided 95 % confidence interval is
``b ± t(0.975, n - 2) · se``. The verdict is **leak** when the interval's lower bound is
above the threshold (so a leak is claimed only when the data make a slope that steep
unlikely to be noise), **ok** otherwise, and **inconclusive** with fewer than three
samples or a single ``x`` value.

The t-quantile comes from a table for 1..30 degrees of freedom and a Cornish-Fisher
expansion above (within 1e-3 there), so no statistics package is needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# t(0.975, df) for df = 1..30
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` >= 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


@dataclass(frozen=True)
class SlopeFit:
    """Slope and intercept in bytes per request / bytes; CI bounds ``nan`` when unknown."""

    n: int
    slope: float
    intercept: float
    ci_low: float
    ci_high: float


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> SlopeFit:
    """Least-squares ``y = intercept + slope * x`` with the slope's 95 % CI."""
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    n = int(x.size)
    if n == 0 or y.size != n:
        return SlopeFit(n, math.nan, math.nan, math.nan, math.nan)
    xm, ym = float(x.mean()), float(y.mean())
    sxx = float(((x - xm) ** 2).sum())
    if n < 2 or sxx == 0.0:
        return SlopeFit(n, math.nan, ym, math.nan, math.nan)
    slope = float(((x - xm) * (y - ym)).sum()) / sxx
    icpt = ym - slope * xm
    if n < 3:
        return SlopeFit(n, slope, icpt, math.nan, math.nan)
    sse = float(((y - (icpt + slope * x)) ** 2).sum())
    se = math.sqrt(sse / (n - 2) / sxx)
    half = t_quantile_975(n - 2) * se
    return SlopeFit(n, slope, icpt, slope - half, slope + half)


def threshold_bytes_per_request(kb_per_1k: float) -> float:
    """``--leak-threshold-kb-per-1k`` (KiB per 1,000 requests) in bytes per request."""
    return kb_per_1k * 1024.0 / 1000.0


def verdict(fit: SlopeFit, threshold_bytes: float) -> str:
    """``"leak"``, ``"ok"`` or ``"inconclusive"`` (see the module docstring)."""
    if math.isnan(fit.ci_low):
        return "inconclusive"
    return "leak" if fit.ci_low > threshold_bytes else "ok"


def kb_per_1k(bytes_per_request: float) -> float:
    """Bytes per request in KiB per 1,000 requests (the unit the verdict prints)."""
    return bytes_per_request * 1000.0 / 1024.0
