"""A 3,000-request soak through a real ``pdserve proxy`` process at 10 requests/s (in
bursts of 5, so the proxy pools several connections per instance), with idle gaps of
4.9-5.1 s and 14.9-15.1 s, against fake instances served by the production uvicorn
runner: zero failures, no instance ever marked down.

The instances' servers really expire idle keep-alive connections: one prefill/decode
pair runs with the production keep-alive (75 s, longer than the proxy's 60 s pool), the
other with stock uvicorn's 5 s (what vLLM instances, and pdserve's before this change,
run with), so the gaps keep finding the proxy's pooled connections to that pair closed
by the server. Inherently about 6 minutes (marked ``slow``; deselect with
``-m "not slow"``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from .procs import gap_plan, metric_sum, running, soak, start_fake, start_proxy

N = 3000
RATE = 10.0


@pytest.mark.slow
@pytest.mark.timeout(590)
def test_soak_with_idle_gaps_has_no_failures(tmp_path: Path) -> None:
    fakes = {}
    for pair, keep_alive in (("prod", []), ("ka5", ["--keep-alive", "5"])):
        for role in ("prefill", "decode"):
            log = tmp_path / f"{role}-{pair}.log"
            fakes[role, pair] = start_fake(role, log, "--delay", "0.03", *keep_alive)
    prefill = [fakes["prefill", p].url for p in ("prod", "ka5")]
    decode = [fakes["decode", p].url for p in ("prod", "ka5")]
    proxy = start_proxy(prefill, decode, tmp_path / "proxy.log")
    gaps = gap_plan(N, short=4, long=2, seed=7)
    t0 = time.monotonic()
    with running(proxy, *fakes.values()):
        res = asyncio.run(soak(proxy.url, N, RATE, gaps, seed=7, burst=5))
        took = time.monotonic() - t0
        assert res.sent == N
        assert res.failures == [], res.failures[:20]
        assert res.ok == N
        for name in (
            "pdserve:proxy_instance_marked_down_total",
            "pdserve:proxy_no_healthy_instance_total",
            "pdserve:proxy_retries_total",
        ):
            assert metric_sum(proxy.url, name) == 0, name
        stats = {key: fake.stats() for key, fake in fakes.items()}
        for key, s in stats.items():
            assert s["requests"] > N / 4, (key, s)  # both pairs served their share
            assert s["verified"] == s["requests"] and s["rejected"] == 0, (key, s)
        # the 5 s pair's server closed idle connections in the gaps, so the proxy had to
        # open new ones; the production pair's connections outlived every gap
        conns = {f"{r}-{p}": s["connections"] for (r, p), s in stats.items()}
        stale = metric_sum(proxy.url, "pdserve:proxy_stale_connection_retries_total")
        print(f"soak: {N} requests in {took:.0f}s, connections {conns}, stale retries {stale}")
        for role in ("prefill", "decode"):
            assert conns[f"{role}-ka5"] > conns[f"{role}-prod"], conns
