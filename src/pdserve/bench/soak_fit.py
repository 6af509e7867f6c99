"""The leak test of ``soak``: RSS against completed requests, growth that flattens told
apart from growth that persists.

For one process, ``x`` = requests completed when a sample was taken and ``y`` = its RSS
in bytes. A fresh server's RSS grows while it warms up (allocator arenas, caches, lazily
built objects) and then flattens; a leak keeps growing. A single line through a short
run mistakes the first for the second, so three fits are made:

* **overall**: the ordinary least-squares line (slope ``b``, standard error
  ``sqrt(SSE / (n - 2) / Sxx)``, 95 % CI ``b ± t(0.975, n - 2) · se``), as a summary;
* **warm-up + steady** (:func:`fit_warmup`): ``y = a + b·x + c·(1 - exp(-(x - x0)/τ))``,
  growth ``c`` that saturates with scale ``τ`` plus a steady slope ``b``. For each ``τ``
  of a geometric grid from 1/40 to 1/4 of the run's ``x`` span (a warm-up must flatten
  within the run to be told apart) the model is linear in ``a, b, c`` and solved by
  least squares; the ``τ`` of the smallest residual is kept, and ``b`` and ``c`` get
  95 % CIs from the fit's covariance with ``n - 4`` degrees of freedom (``τ`` counted);
* **tail**: the least-squares line through the second half of the samples (by ``x``):
  what is left of the growth once the warm-up is over, whatever its shape.

The verdict is **leak** only when the steady slope *and* the tail slope both have their
CI's lower bound above the threshold: a slope that persists through the whole run and
into its second half, which noise or a flattening warm-up make unlikely; **ok**
otherwise, and **inconclusive** with fewer than six samples (or too few distinct ``x``
values) to fit the model.

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


MIN_SAMPLES = 6  # the warm-up model has four parameters; its CIs need a few more points
_TAU_STEPS = 24


@dataclass(frozen=True)
class WarmupFit:
    """``y = a + b·x + c·(1 - exp(-(x - x0)/τ))``: the steady slope ``b`` (bytes per
    request) and the warm-up growth ``c`` (bytes) with their 95 % CIs (``nan`` when
    unknown), the scale ``tau`` (requests) and ``x0`` (the first sample's ``x``)."""

    n: int
    slope: float
    slope_ci_low: float
    slope_ci_high: float
    warmup: float
    warmup_ci_low: float
    warmup_ci_high: float
    tau: float
    x0: float
    intercept: float


def _nan_warmup(n: int) -> WarmupFit:
    nan = math.nan
    return WarmupFit(n, nan, nan, nan, nan, nan, nan, nan, nan, nan)


def fit_warmup(xs: Sequence[float], ys: Sequence[float]) -> WarmupFit:
    """The warm-up + steady-slope model of the module docstring (least squares over a
    grid of ``τ``)."""
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    n = int(x.size)
    if n < MIN_SAMPLES or y.size != n or np.unique(x).size < MIN_SAMPLES - 1:
        return _nan_warmup(n)
    x0 = float(x.min())
    t = x - x0
    span = float(t.max())
    best: tuple[float, float, np.ndarray, np.ndarray] | None = None  # sse, tau, coef, design
    for tau in np.geomspace(span / 40, span / 4, _TAU_STEPS):
        design = np.column_stack([np.ones(n), t, 1.0 - np.exp(-t / tau)])
        coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        sse = float(((y - design @ coef) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, float(tau), coef, design)
    assert best is not None
    sse, tau, coef, design = best
    try:
        cov = np.linalg.inv(design.T @ design) * (sse / (n - 4))
    except np.linalg.LinAlgError:
        return _nan_warmup(n)
    half = t_quantile_975(n - 4) * np.sqrt(np.maximum(np.diag(cov), 0.0))
    a, b, c = (float(v) for v in coef)
    return WarmupFit(
        n, b, b - float(half[1]), b + float(half[1]),
        c, c - float(half[2]), c + float(half[2]), tau, x0, a,
    )  # fmt: skip


def fit_tail(xs: Sequence[float], ys: Sequence[float]) -> SlopeFit:
    """:func:`fit_slope` over the second half of the samples (by ``x``)."""
    order = np.argsort(np.asarray(xs, dtype=np.float64), kind="stable")
    keep = order[len(order) // 2 :]
    return fit_slope([xs[i] for i in keep], [ys[i] for i in keep])


def leak_verdict(steady: WarmupFit, tail: SlopeFit, threshold_bytes: float) -> str:
    """``"leak"``, ``"ok"`` or ``"inconclusive"`` (see the module docstring)."""
    if math.isnan(steady.slope_ci_low) or math.isnan(tail.ci_low):
        return "inconclusive"
    persists = steady.slope_ci_low > threshold_bytes and tail.ci_low > threshold_bytes
    return "leak" if persists else "ok"
