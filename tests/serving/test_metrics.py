"""/metrics: vLLM-named series with the SLA bucket edges; per-request timings."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.core_types.stats import SchedulerStats
from pdserve.metrics.prometheus import (
    ITL_BUCKETS,
    TTFT_BUCKETS,
    PrometheusMetrics,
    build_1_2_5_buckets,
)

from .conftest import MODEL, FakeEngineClient, ServerFactory


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def labels(**extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"model_name": MODEL, "engine": "0", **extra}.items()))


def test_metrics_endpoint_series(make_server: ServerFactory) -> None:
    server = make_server(FakeEngineClient())
    with httpx.Client(base_url=server.url, timeout=10) as c:
        assert (
            c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4}).status_code == 200
        )
        body = {"prompt": "hi", "max_tokens": 3, "stream": True}
        assert c.post("/v1/completions", json=body).status_code == 200
        r = c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    s = samples(r.text)
    assert s[("pdserve:time_to_first_token_seconds_bucket", labels(le="0.02"))] >= 0
    assert s[("pdserve:time_to_first_token_seconds_bucket", labels(le="2.5"))] == 2
    assert ("pdserve:inter_token_latency_seconds_bucket", labels(le="0.02")) in s
    assert ("pdserve:request_time_per_output_token_seconds_bucket", labels(le="0.02")) in s
    assert s[("pdserve:inter_token_latency_seconds_count", labels())] == 3 + 2
    assert s[("pdserve:request_time_per_output_token_seconds_count", labels())] == 2
    assert s[("pdserve:e2e_request_latency_seconds_count", labels())] == 2
    assert s[("pdserve:prompt_tokens_total", labels())] == 6 + 3
    assert s[("pdserve:generation_tokens_total", labels())] == 7
    assert s[("pdserve:request_success_total", labels(finished_reason="length"))] == 2
    assert s[("pdserve:request_success_total", labels(finished_reason="abort"))] == 0
    assert s[("pdserve:request_prompt_tokens_sum", labels())] == 9
    assert s[("pdserve:request_generation_tokens_sum", labels())] == 7
    assert s[("pdserve:num_requests_running", labels())] == 0
    assert s[("pdserve:num_requests_waiting", labels())] == 0
    assert s[("pdserve:kv_cache_usage_perc", labels())] == 0.25
    assert s[("pdserve:prefix_cache_queries_total", labels())] == 100
    assert s[("pdserve:prefix_cache_hits_total", labels())] == 40
    assert s[("pdserve:num_preemptions_total", labels())] == 2
    assert s[("pdserve:prompt_tokens_by_source_total", labels(source="local_cache_hit"))] == 40
    assert s[("pdserve:forward_steps_total", labels(path="graph"))] == 7
    assert s[("pdserve:forward_steps_total", labels(path="eager:prefill"))] == 3
    assert s[("pdserve:process_rss_bytes", labels(process="api_server"))] > 1_000_000


def test_bucket_edges() -> None:
    assert 0.02 in TTFT_BUCKETS and 2.5 in TTFT_BUCKETS and len(TTFT_BUCKETS) == 22
    assert 0.02 in ITL_BUCKETS and 0.01 in ITL_BUCKETS and 0.025 in ITL_BUCKETS
    assert list(ITL_BUCKETS) == sorted(ITL_BUCKETS)
    assert build_1_2_5_buckets(128) == [1, 2, 5, 10, 20, 50, 100]


def test_request_timings_from_arrival() -> None:
    m = PrometheusMetrics("m", stats_provider=lambda: None, max_model_len=100)
    t = m.start_request(arrival_time=10.0, prompt_tokens=7)
    t.on_output(1, now=10.5)  # TTFT 0.5
    t.on_output(0, now=10.51)  # no tokens: ignored
    t.on_output(2, now=10.52)  # ITL 0.02 (one sample per delta)
    t.on_output(1, now=10.56)  # ITL 0.04
    t.finish("stop", now=11.0)
    t.finish("stop", now=12.0)  # ignored
    reg = m.registry
    lab = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("pdserve:time_to_first_token_seconds_sum", lab) == 0.5
    assert reg.get_sample_value("pdserve:inter_token_latency_seconds_count", lab) == 2
    assert (
        reg.get_sample_value("pdserve:inter_token_latency_seconds_bucket", {**lab, "le": "0.02"})
        == 1
    )
    tpot = reg.get_sample_value("pdserve:request_time_per_output_token_seconds_sum", lab)
    assert abs(tpot - 0.06 / 3) < 1e-9
    e2e = reg.get_sample_value("pdserve:e2e_request_latency_seconds_sum", lab)
    assert abs(e2e - 0.56) < 1e-9  # until the last token
    assert reg.get_sample_value("pdserve:generation_tokens_total", lab) == 4
    assert reg.get_sample_value("pdserve:prompt_tokens_total", lab) == 7
    assert (
        reg.get_sample_value("pdserve:request_success_total", {**lab, "finished_reason": "stop"})
        == 1
    )
    # engine series are left out (not zero) when there is no snapshot; RSS stays
    assert reg.get_sample_value("pdserve:num_requests_running", lab) is None
    assert reg.get_sample_value("pdserve:process_rss_bytes", {**lab, "process": "api_server"})


def test_engine_rss_from_stats_and_failing_provider() -> None:
    stats = SchedulerStats()
    stats.process_rss_bytes = {"engine_core": 12345}  # type: ignore[attr-defined]
    m = PrometheusMetrics("m", stats_provider=lambda: stats, max_model_len=10)
    lab = {"model_name": "m", "engine": "0"}
    assert (
        m.registry.get_sample_value("pdserve:process_rss_bytes", {**lab, "process": "engine_core"})
        == 12345
    )

    def broken() -> SchedulerStats:
        raise RuntimeError("engine gone")

    m2 = PrometheusMetrics("m", stats_provider=broken, max_model_len=10)
    body, _ = m2.render()
    assert b"pdserve:process_rss_bytes" in body


def test_two_apps_have_separate_registries(make_server: ServerFactory) -> None:
    a = make_server(FakeEngineClient())
    b = make_server(FakeEngineClient())
    with httpx.Client(timeout=10) as c:
        assert (
            c.post(a.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code
            == 200
        )
        sa = samples(c.get(a.url + "/metrics").text)
        sb = samples(c.get(b.url + "/metrics").text)
    assert sa[("pdserve:generation_tokens_total", labels())] == 2
    assert sb[("pdserve:generation_tokens_total", labels())] == 0


def test_rejected_requests_are_not_counted(make_server: ServerFactory) -> None:
    server = make_server(FakeEngineClient())
    with httpx.Client(base_url=server.url, timeout=10) as c:
        assert (
            c.post("/v1/completions", json={"prompt": "REJECT", "max_tokens": 2}).status_code == 400
        )
        assert c.post("/v1/completions", json={"prompt": [1, 300]}).status_code == 400
        s = samples(c.get("/metrics").text)
    assert s[("pdserve:e2e_request_latency_seconds_count", labels())] == 0
    assert s[("pdserve:request_success_total", labels(finished_reason="abort"))] == 0
