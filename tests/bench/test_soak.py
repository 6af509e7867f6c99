"""``pdserve soak``: the slope statistics, and runs against a fake server whose reported
API-process RSS grows by a set number of bytes per request."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.bench.soak_fit import (
    fit_slope,
    fit_tail,
    fit_warmup,
    leak_verdict,
    t_quantile_975,
    threshold_bytes_per_request,
    verdict,
)
from pdserve.cli import main as cli_main


def test_t_quantile() -> None:
    assert t_quantile_975(1) == 12.706 and t_quantile_975(30) == 2.042
    assert t_quantile_975(31) == pytest.approx(2.040, abs=1e-3)
    assert t_quantile_975(60) == pytest.approx(2.000, abs=1e-3)
    assert t_quantile_975(120) == pytest.approx(1.980, abs=1e-3)
    assert t_quantile_975(10**6) == pytest.approx(1.960, abs=1e-3)
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_fit_slope_and_verdict() -> None:
    rng = np.random.default_rng(0)
    x = np.linspace(0, 2000, 40)
    y = 3e8 + 500.0 * x + rng.normal(0, 2e5, x.size)
    fit = fit_slope(x.tolist(), y.tolist())
    assert fit.ci_low < 500.0 < fit.ci_high and fit.n == 40
    assert verdict(fit, threshold_bytes_per_request(64)) == "leak"
    assert verdict(fit, 1000.0) == "ok"
    flat = fit_slope(x.tolist(), (3e8 + rng.normal(0, 2e5, x.size)).tolist())
    assert verdict(flat, threshold_bytes_per_request(64)) == "ok"
    # too few points, or one x value: no interval
    assert verdict(fit_slope([0, 1], [1, 2]), 0.0) == "inconclusive"
    assert verdict(fit_slope([5, 5, 5], [1, 2, 3]), 0.0) == "inconclusive"
    assert math.isnan(fit_slope([], []).slope)
    # coverage: the 95 % interval holds the true slope about 95 % of the time
    hits = 0
    for _ in range(400):
        xs = np.arange(8.0)
        f = fit_slope(xs.tolist(), (2.0 * xs + rng.normal(0, 1, 8)).tolist())
        hits += f.ci_low <= 2.0 <= f.ci_high
    assert 0.91 <= hits / 400 <= 0.99


def _warmup_rss(x: np.ndarray, amplitude: float, tau: float) -> np.ndarray:
    return amplitude * (1.0 - np.exp(-x / tau))


def test_warmup_is_told_apart_from_a_leak() -> None:
    """The report's case: a short run whose RSS grows fast and flattens (a warm-up) makes
    one line's slope look like a leak; the warm-up model and the second half say it is
    not. A real leak (here with a warm-up on top) is still one; no growth is ok."""
    rng = np.random.default_rng(1)
    x = np.linspace(0, 6000, 60)
    limit = threshold_bytes_per_request(64)  # 64 KiB per 1,000 requests
    noise = rng.normal(0, 100e3, x.size)
    cases = {
        # 40 MiB of warm-up over the first ~1,000 requests, nothing after
        "warm-up": 3e8 + _warmup_rss(x, 40 * 2**20, 300) + noise,
        # the same warm-up and a steady 400 B/request (390 KiB per 1,000 requests)
        "leak": 3e8 + _warmup_rss(x, 40 * 2**20, 300) + 400 * x + noise,
        "flat": 3e8 + noise,
    }
    got = {}
    for name, y in cases.items():
        xs, ys = x.tolist(), y.tolist()
        warm, tail = fit_warmup(xs, ys), fit_tail(xs, ys)
        got[name] = leak_verdict(warm, tail, limit)
        if name == "warm-up":
            assert verdict(fit_slope(xs, ys), limit) == "leak"  # what one line said
            assert warm.warmup_ci_low < 40 * 2**20 < warm.warmup_ci_high
            assert warm.slope_ci_low < limit
        if name == "leak":
            assert warm.slope_ci_low < 400 < warm.slope_ci_high
            assert tail.ci_low < 400 < tail.ci_high
    assert got == {"warm-up": "ok", "leak": "leak", "flat": "ok"}
    # too few samples for the model: no verdict
    assert leak_verdict(fit_warmup([1, 2, 3], [1, 2, 3]), fit_tail([1, 2, 3], [1, 2, 3]), 0) == (
        "inconclusive"
    )


def _argv(url: str, tok: Path, out: Path, *extra: str) -> list[str]:
    return ["soak", "--base-url", url, "--tokenizer", str(tok), "--num-requests", "300",
            "--request-rate", "300", "--random-input-len", "8", "--random-output-len", "2",
            "--warmup-requests", "10", "--sample-interval-s", "0.1", "--disable-tqdm",
            "--result-dir", str(out), *extra]  # fmt: skip


@pytest.mark.parametrize(("leak", "warmup"), [(0, 0), (20_000, 0), (0, 50_000_000)])
def test_soak_against_fake_server(
    leak: int,
    warmup: int,
    fake_server: Callable[..., Any],
    tiny_tokenizer_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A planted leak (20 KB per request) is LEAK; a warm-up of 50 MB that flattens
    within the first ~50 requests (a line through the run: ~160 KiB per request) is not."""
    srv = fake_server(
        ttft_s=0.002,
        itl_s=0.001,
        rss_bytes_per_request=leak,
        rss_warmup_bytes=warmup,
        rss_warmup_requests=10.0,
    )
    rc = cli_main(_argv(srv.url, tiny_tokenizer_dir, tmp_path))
    (summary,) = tmp_path.glob("soak-*.json")
    res = json.loads(summary.read_text())
    by = {r["process"]: r for r in res["processes"]}
    api, core = by[f"{srv.url}/metrics api_server"], by[f"{srv.url}/metrics engine_core"]
    assert core["verdict"] == "inconclusive" or core["verdict"] == "ok"  # flat
    assert res["completed"] == 300 and res["failed"] == 0
    if leak:
        assert rc == 1 and api["verdict"] == "leak"
        # the client's completed count trails the server's by the requests in flight
        assert api["slope_bytes_per_request"] == pytest.approx(leak, rel=0.3)
        assert "LEAK in" in capsys.readouterr().err
    else:
        assert rc == 0 and api["verdict"] == "ok", api
    if warmup:  # a steep line through the run, but growth that flattened: a warm-up
        assert api["slope_kb_per_1k"] > 64 and api["warmup_mib"] > 10
    assert api["samples"] >= 6
    with open(res["csv"], encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert {r["process"] for r in rows} == {"api_server", "engine_core"}
    assert all(r["kv_cache_usage_perc"] != "" and r["num_requests_running"] != "" for r in rows)
    assert [int(r["completed"]) for r in rows] == sorted(int(r["completed"]) for r in rows)
    assert Path(res["plot"]).read_bytes()[:4] == b"\x89PNG"


def test_soak_needs_rss_series_and_a_length(
    fake_server: Callable[..., Any], tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    srv = fake_server(ttft_s=0.001, itl_s=0.001, metrics=False)
    argv = _argv(srv.url, tiny_tokenizer_dir, tmp_path, "--no-plot")
    argv[argv.index("--num-requests") + 1] = "20"
    assert cli_main(argv) == 2  # nothing to judge
    assert cli_main(["soak", "--base-url", srv.url, "--tokenizer", str(tiny_tokenizer_dir)]) == 2
