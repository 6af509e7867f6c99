"""``bench serve`` reports the run's prefix-cache hit rate from the server's /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.scrape import (
    PrefixCacheCounters,
    find,
    parse_exposition,
    prefix_cache_result,
    read_prefix_cache,
    total,
)
from pdserve.bench.serve import run_benchmark

EXPOSITION = """\
# HELP pdserve:prefix_cache_hits Prompt tokens found in the prefix cache.
# TYPE pdserve:prefix_cache_hits counter
pdserve:prefix_cache_hits_total{engine="0",model_name="m"} 30.0
pdserve:prefix_cache_hits_total{engine="1",model_name="m"} 10.0
pdserve:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
pdserve:prefix_cache_queries_total{engine="1",model_name="m"} 60.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:num_requests_running{model_name="m"} 3
pdserve:process_rss_bytes{engine="0",model_name="a \\"q\\", b",process="api_server"} 1.5e+08
broken line
"""


def test_parse_exposition_and_prefix_rules() -> None:
    samples = parse_exposition(EXPOSITION)
    assert total(samples, "prefix_cache_hits") == 40.0
    assert total(samples, "prefix_cache_queries") == 160.0  # pdserve: only, no double count
    assert total(samples, "num_requests_running") == 3.0  # vllm: when pdserve: is absent
    assert total(samples, "kv_cache_usage_perc") is None
    (rss,) = find(samples, "process_rss_bytes")
    assert rss.labels == {"engine": "0", "model_name": 'a "q", b', "process": "api_server"}
    assert rss.value == 1.5e8


def test_prefix_cache_result_edges() -> None:
    a, b = PrefixCacheCounters(100, 40), PrefixCacheCounters(300, 140)
    assert prefix_cache_result(a, b) == {
        "prefix_cache_hit_rate": 0.5,
        "prefix_cache_hits": 100,
        "prefix_cache_queries": 200,
        "prefix_cache_note": None,
    }
    assert prefix_cache_result(a, a)["prefix_cache_hit_rate"] is None
    assert "backwards" in prefix_cache_result(b, a)["prefix_cache_note"]
    missing = PrefixCacheCounters(None, None, "x: no series")
    assert prefix_cache_result(a, missing)["prefix_cache_note"] == "x: no series"


def _flags(url: str, tok: Path, **kw: Any) -> dict[str, Any]:
    flags: dict[str, Any] = {
        "base_url": url,
        "tokenizer": str(tok),
        "num_prompts": 6,
        "random_input_len": 12,
        "random_output_len": 3,
        "disable_tqdm": True,
        "request_id_prefix": "t-",
    }
    flags.update(kw)
    return flags


def test_hit_rate_in_result_and_summary(
    fake_server: Callable[..., Any],
    tiny_tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    srv = fake_server(ttft_s=0.005, itl_s=0.001, prefix_hit_ratio=0.5)
    res = run_benchmark(**_flags(srv.url, tiny_tokenizer_dir, num_warmups=3))
    main_words = sum(len(p["prompt"].split()) for p in srv.payloads[3:])  # after warm-ups
    assert res["prefix_cache_queries"] == main_words
    assert res["prefix_cache_hits"] == sum(
        int(len(p["prompt"].split()) * 0.5) for p in srv.payloads[3:]
    )
    assert res["prefix_cache_hit_rate"] == pytest.approx(res["prefix_cache_hits"] / main_words)
    assert res["prefix_cache_note"] is None
    out = capsys.readouterr().out
    assert "Prefix cache hit rate:" in out and f"of {main_words} prompt tokens" in out


def test_no_counters_gives_null_with_reason(
    fake_server: Callable[..., Any], tiny_tokenizer_dir: Path
) -> None:
    srv = fake_server(ttft_s=0.005, itl_s=0.001, metrics=False)
    res = run_benchmark(**_flags(srv.url, tiny_tokenizer_dir))
    assert res["completed"] == 6
    assert res["prefix_cache_hit_rate"] is None and res["prefix_cache_hits"] is None
    assert "HTTP 404" in res["prefix_cache_note"]


def test_metrics_urls_are_summed(fake_server: Callable[..., Any], tiny_tokenizer_dir: Path) -> None:
    front = fake_server(ttft_s=0.005, itl_s=0.001, prefix_hit_ratio=1.0)
    other = fake_server(prefix_hit_ratio=0.0)
    urls = [front.url, other.url + "/metrics"]
    before = asyncio.run(
        read_prefix_cache([u if u.endswith("metrics") else u + "/metrics" for u in urls])
    )
    assert (before.queries, before.hits) == (0.0, 0.0)
    res = run_benchmark(**_flags(front.url, tiny_tokenizer_dir, metrics_url=urls))
    # the second instance saw no traffic: its zero counters still count in the sum
    assert res["prefix_cache_hit_rate"] == 1.0
    proxy_like = fake_server(metrics=True)
    proxy_like.behavior.metrics = False
    res = run_benchmark(
        **_flags(front.url, tiny_tokenizer_dir, metrics_url=[front.url, proxy_like.url])
    )
    assert res["prefix_cache_hit_rate"] is None and proxy_like.url in res["prefix_cache_note"]
