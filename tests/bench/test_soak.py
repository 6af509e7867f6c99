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

from pdserve.bench.soak_fit import fit_slope, t_quantile_975, threshold_bytes_per_request, verdict
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


def _argv(url: str, tok: Path, out: Path, *extra: str) -> list[str]:
    return ["soak", "--base-url", url, "--tokenizer", str(tok), "--num-requests", "300",
            "--request-rate", "300", "--random-input-len", "8", "--random-output-len", "2",
            "--warmup-requests", "10", "--sample-interval-s", "0.1", "--disable-tqdm",
            "--result-dir", str(out), *extra]  # fmt: skip


@pytest.mark.parametrize("leak", [0, 20_000])
def test_soak_against_fake_server(
    leak: int,
    fake_server: Callable[..., Any],
    tiny_tokenizer_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    srv = fake_server(ttft_s=0.002, itl_s=0.001, rss_bytes_per_request=leak)
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
        assert rc == 0 and api["verdict"] in ("ok", "inconclusive")
    assert api["samples"] >= 3
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
