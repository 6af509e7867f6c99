"""Aggregate metrics against hand-computed values for synthetic per-request records."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.metrics import (
    calculate_metrics,
    count_good,
    peak_concurrency,
    peak_output_tokens_per_s,
    percentile_label,
    summarize,
)
from pdserve.bench.records import RequestOutput


def _ok(start: float, ttft: float, itl: list[float], out: int | None, prompt: int) -> RequestOutput:
    return RequestOutput(
        success=True,
        start_time=start,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        output_tokens=out,
        prompt_len=prompt,
        generated_text="x " * (out or 0),
    )


def _records() -> list[RequestOutput]:
    r1 = _ok(0.0, 0.1, [0.05, 0.05, 0.1], 4, 10)  # latency 0.3, tpot 0.2/3
    r2 = _ok(0.5, 0.2, [0.5], 2, 20)  # latency 0.7, tpot 0.5
    r3 = _ok(1.0, 0.4, [], 1, 5)  # latency 0.4, 1 token: no tpot
    r4 = RequestOutput(success=False, start_time=0.2, prompt_len=99, error="HTTP 500")
    return [r1, r2, r3, r4]


def test_counts_and_throughputs() -> None:
    m, lens = calculate_metrics(_records(), 2.0, [99.0])
    assert lens == [4, 2, 1, 0]
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 35  # failed request's prompt excluded
    assert m.total_output == 7
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(21.0)
    assert m.request_goodput == 0.0  # no SLOs configured


def test_latency_statistics_ms() -> None:
    m, _ = calculate_metrics(_records(), 2.0, [99.0, 50.0])
    ttft = m.stats["ttft"]
    assert ttft.mean == pytest.approx(700 / 3)
    assert ttft.median == pytest.approx(200.0)
    assert ttft.std == pytest.approx(
        math.sqrt(((100 - 700 / 3) ** 2 + (200 - 700 / 3) ** 2 + (400 - 700 / 3) ** 2) / 3)
    )
    assert dict(ttft.percentiles)[99.0] == pytest.approx(396.0)  # linear: 200 + 0.98*200
    assert dict(ttft.percentiles)[50.0] == pytest.approx(200.0)

    tpot = m.stats["tpot"]  # per-request mean over requests with > 1 token only
    assert tpot.mean == pytest.approx((200 / 3 + 500) / 2)
    assert dict(tpot.percentiles)[99.0] == pytest.approx(200 / 3 + 0.99 * (500 - 200 / 3))

    itl = m.stats["itl"]  # pooled gaps [50, 50, 100, 500]
    assert itl.mean == pytest.approx(175.0)
    assert itl.median == pytest.approx(75.0)
    assert dict(itl.percentiles)[99.0] == pytest.approx(100 + 0.97 * 400)

    e2el = m.stats["e2el"]
    assert e2el.mean == pytest.approx(1400 / 3)
    assert e2el.median == pytest.approx(400.0)


def test_goodput_requires_all_slos_and_one_token_tpot_is_zero() -> None:
    recs = _records()
    m, _ = calculate_metrics(recs, 2.0, [99.0], goodput_slos_ms={"ttft": 250, "tpot": 100})
    assert m.request_goodput == pytest.approx(1 / 2.0)  # only r1 meets both
    m, _ = calculate_metrics(recs, 2.0, [99.0], goodput_slos_ms={"tpot": 100})
    assert m.request_goodput == pytest.approx(2 / 2.0)  # r1, and r3 with tpot 0
    m, _ = calculate_metrics(recs, 2.0, [99.0], goodput_slos_ms={"e2el": 400})
    assert m.request_goodput == pytest.approx(2 / 2.0)  # r1 (300) and r3 (400 <= 400)
    assert count_good([0.1], [0.0], [0.1], {}) == 0


def test_peaks() -> None:
    ok = [r for r in _records() if r.success]
    # token chunk times: r1 .1 .15 .2 .3 | r2 .7 1.2 | r3 1.4 -> buckets [5, 2]
    assert peak_output_tokens_per_s(ok) == 5.0
    assert peak_concurrency(ok) == 2  # [0.5, 1.2) overlaps [1.0, 1.4)
    back_to_back = [_ok(0.0, 1.0, [], 1, 1), _ok(1.0, 1.0, [], 1, 1)]
    assert peak_concurrency(back_to_back) == 1  # half-open intervals
    assert peak_output_tokens_per_s([]) == 0.0
    assert peak_concurrency([]) == 0
    m, _ = calculate_metrics(_records(), 2.0, [99.0])
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (5.0, 2)


def test_output_token_fallback() -> None:
    r = _ok(0.0, 0.1, [0.1, 0.1], None, 3)
    r.generated_text = "one two three"
    _, lens = calculate_metrics([r], 1.0, [99.0], count_tokens=lambda t: len(t.split()))
    assert lens == [3]
    _, lens = calculate_metrics([r], 1.0, [99.0])
    assert lens == [1]  # no tokenizer: vLLM counts 1


def test_all_failed_reports_zeros() -> None:
    m, lens = calculate_metrics([RequestOutput(error="x")], 1.0, [99.0])
    assert (m.completed, m.failed, lens) == (0, 1, [0])
    assert m.stats["ttft"].mean == 0.0 and dict(m.stats["ttft"].percentiles)[99.0] == 0.0
    assert m.max_concurrent_requests == 0


def test_client_queue_metrics_only_with_cap() -> None:
    recs = _records()
    recs[0].client_queue_time = 0.5
    m, _ = calculate_metrics(recs, 2.0, [99.0])
    assert "client_queue_time" not in m.stats
    m, _ = calculate_metrics(recs, 2.0, [99.0], max_concurrency=2)
    assert m.stats["client_queue_time"].mean == pytest.approx(500 / 3)
    assert "e2el_including_client_queue" not in m.stats  # infinite rate
    m, _ = calculate_metrics(recs, 2.0, [99.0], max_concurrency=2, request_rate=4.0)
    assert m.stats["e2el_including_client_queue"].mean == pytest.approx((800 + 700 + 400) / 3)


def test_helpers() -> None:
    assert percentile_label(99.0) == "99"
    assert percentile_label(99.9) == "99.9"
    s = summarize([], [50.0])
    assert (s.mean, s.median, s.std, s.percentiles) == (0.0, 0.0, 0.0, ((50.0, 0.0),))
    with pytest.raises(ValueError):
        calculate_metrics([], 0.0, [99.0])
