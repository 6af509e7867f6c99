"""Aggregate metrics from per-request records: pure functions, ``vllm bench serve`` rules.

* Failed requests are dropped from every statistic (they count in ``failed`` only).
* Output tokens per request: ``usage.completion_tokens``; when not reported, the
  generated text is re-tokenized with ``count_tokens`` (``add_special_tokens=False``),
  or taken as 1 without a tokenizer.
* TPOT per request ``(latency - ttft)/(out - 1)`` only for ``out > 1``; the reported
  TPOT statistics are over those requests. For goodput a 1-token request has tpot 0.
* ITL statistics pool every inter-chunk gap of every successful request.
* Statistics are ``np.mean/np.median/np.std/np.percentile`` (linear) in ms; an
  empty sample reports 0 for all of them (vLLM's ``np.mean(x or 0)``).
* Goodput: a request is good when, for every configured SLO, metric <= SLO;
  ``request_goodput = good / duration``.
* ``max_output_tokens_per_s``: token chunks (first chunk + one per ITL gap) binned
  into 1-s buckets counted from the earliest successful start; the busiest bucket.
* ``max_concurrent_requests``: exact sweep over half-open ``[start, start+latency)``.
* ``offered_request_rate`` / ``achieved_request_rate`` (:func:`sustained_rates`, runs
  at a finite request rate): the rate at which the run's successful requests arrived
  and the rate at which they completed, each over the middle 80% of its events (the
  10th to the 90th percentile arrival, and completion; a least-squares fit of event time
  against event number). A server that keeps up
  completes requests as fast as they arrive; one that cannot builds a queue and
  completes them at its own pace, so the achieved rate falls below the offered one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.records import RequestOutput

MS_PER_S = 1000.0
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = (
    "ttft",
    "tpot",
    "itl",
    "e2el",
    "client_queue_time",
    "e2el_including_client_queue",
)


@dataclass(frozen=True)
class MetricStats:
    """Summary of one latency sample, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class BenchmarkMetrics:
    """Run-level aggregates. ``stats`` maps a metric name (``PERCENTILE_METRICS``) to ms stats.

    ``client_queue_time`` is present only with a concurrency cap, and
    ``e2el_including_client_queue`` only with a cap and a finite request rate.
    """

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, MetricStats] = field(default_factory=dict)


def percentile_label(p: float) -> str:
    """``99.0 -> "99"``, ``99.9 -> "99.9"`` (the ``pNN`` in result keys)."""
    return str(int(p)) if int(p) == p else str(p)


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
    """Mean/median/std/percentiles of a sample in seconds, reported in ms."""
    arr = np.asarray(values_s, dtype=np.float64) if len(values_s) else np.zeros(1)
    return MetricStats(
        mean=float(np.mean(arr)) * MS_PER_S,
        median=float(np.median(arr)) * MS_PER_S,
        std=float(np.std(arr)) * MS_PER_S,
        percentiles=tuple((float(p), float(np.percentile(arr, p)) * MS_PER_S) for p in percentiles),
    )


def output_lengths(
    outputs: Sequence[RequestOutput], count_tokens: Callable[[str], int] | None
) -> list[int]:
    """Per-request output token counts; 0 for failed requests."""
    lens: list[int] = []
    for o in outputs:
        if not o.success:
            lens.append(0)
        elif o.output_tokens:
            lens.append(int(o.output_tokens))
        elif count_tokens is None:
            lens.append(1)
        else:
            lens.append(int(count_tokens(o.generated_text)))
    return lens


def peak_output_tokens_per_s(successful: Sequence[RequestOutput]) -> float:
    """Most token chunks received within one 1-s bucket (see module doc)."""
    if not successful:
        return 0.0
    t0 = min(o.start_time for o in successful)
    t_end = max(o.start_time + o.latency for o in successful)
    n_buckets = int(np.ceil(t_end - t0)) + 1
    counts = np.zeros(n_buckets, dtype=np.int64)
    for o in successful:
        times = np.cumsum(np.asarray([o.start_time + o.ttft, *o.itl], dtype=np.float64))
        buckets = (times - t0).astype(np.int64)  # truncation == floor for t >= t0
        buckets = buckets[(buckets >= 0) & (buckets < n_buckets)]
        counts += np.bincount(buckets, minlength=n_buckets)[:n_buckets]
    return float(counts.max())


def peak_concurrency(successful: Sequence[RequestOutput]) -> int:
    """Max number of simultaneously open ``[start, start+latency)`` intervals."""
    events: list[tuple[float, int]] = []
    for o in successful:
        events.append((o.start_time, 1))
        events.append((o.start_time + o.latency, -1))
    events.sort()  # at equal times -1 (end) sorts before +1 (start)
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def count_good(
    ttfts: Sequence[float],
    tpots: Sequence[float],
    e2els: Sequence[float],
    slos_ms: Mapping[str, float],
) -> int:
    """Requests meeting every SLO (values in s, SLOs in ms, ``tpots`` 0 for 1-token outputs)."""
    columns: list[tuple[Sequence[float], float]] = []
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("e2el", e2els)):
        if name in slos_ms:
            columns.append((values, slos_ms[name] / MS_PER_S))
    if not columns:
        return 0
    n = len(ttfts)
    return sum(1 for i in range(n) if all(vals[i] <= slo for vals, slo in columns))


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    dur_s: float,
    selected_percentiles: Sequence[float],
    goodput_slos_ms: Mapping[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
) -> tuple[BenchmarkMetrics, list[int]]:
    """Aggregate ``outputs`` of a run lasting ``dur_s`` seconds; also return output lengths."""
    if dur_s <= 0:
        raise ValueError(f"duration must be positive, got {dur_s}")
    out_lens = output_lengths(outputs, count_tokens)
    ok = [(o, n) for o, n in zip(outputs, out_lens, strict=True) if o.success]
    ttfts = [o.ttft for o, _ in ok]
    e2els = [o.latency for o, _ in ok]
    tpots = [(o.latency - o.ttft) / (n - 1) for o, n in ok if n > 1]
    all_tpots = [(o.latency - o.ttft) / (n - 1) if n > 1 else 0.0 for o, n in ok]
    itls = [gap for o, _ in ok for gap in o.itl]
    successful = [o for o, _ in ok]
    completed = len(ok)
    total_input = sum(o.prompt_len for o in successful)
    total_output = sum(out_lens)
    good = count_good(ttfts, all_tpots, e2els, goodput_slos_ms or {})

    stats = {
        "ttft": summarize(ttfts, selected_percentiles),
        "tpot": summarize(tpots, selected_percentiles),
        "itl": summarize(itls, selected_percentiles),
        "e2el": summarize(e2els, selected_percentiles),
    }
    if max_concurrency is not None:
        queue = [o.client_queue_time for o in successful]
        stats["client_queue_time"] = summarize(queue, selected_percentiles)
        if not math.isinf(request_rate):
            incl = [o.latency + o.client_queue_time for o in successful]
            stats["e2el_including_client_queue"] = summarize(incl, selected_percentiles)

    metrics = BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / dur_s,
        request_goodput=good / dur_s,
        output_throughput=total_output / dur_s,
        total_token_throughput=(total_input + total_output) / dur_s,
        max_output_tokens_per_s=peak_output_tokens_per_s(successful),
        max_concurrent_requests=peak_concurrency(successful),
        stats=stats,
    )
    return metrics, out_lens


def sustained_rates(
    outputs: Sequence[RequestOutput], request_rate: float
) -> dict[str, float | None]:
    """``offered_request_rate`` and ``achieved_request_rate`` in req/s (see the module
    doc); None for a run without a finite request rate or with under 10 successes."""
    ok = [o for o in outputs if o.success]
    none: dict[str, float | None] = {"offered_request_rate": None, "achieved_request_rate": None}
    if math.isinf(request_rate) or len(ok) < 10:
        return none
    lo, hi = round(0.1 * (len(ok) - 1)), round(0.9 * (len(ok) - 1)) + 1
    k = np.arange(lo, hi, dtype=np.float64)
    rates = []
    for times in ([o.start_time - o.client_queue_time for o in ok],
                  [o.start_time + o.latency for o in ok]):  # fmt: skip
        # seconds per event: the least-squares slope of the k-th time against k, which
        # averages out the latency noise two single events would carry
        slope = float(np.polyfit(k, np.sort(times)[lo:hi], 1)[0])
        if not slope > 0:
            return none
        rates.append(1.0 / slope)
    return {"offered_request_rate": rates[0], "achieved_request_rate": rates[1]}
