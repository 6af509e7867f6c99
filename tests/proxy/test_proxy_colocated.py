"""The proxy in front of colocated instances: load spread, health, retries, streams,
kv_transfer_params, and every route."""

from __future__ import annotations

import argparse
import concurrent.futures
import signal
from pathlib import Path

import httpx
import openai
import pytest

from _polling import wait_until
from pdserve.core_types.pd_auth import SECRET_ENV
from pdserve.serving.proxy import cli as proxy_mod
from pdserve.serving.proxy.app import build_proxy_app

from .conftest import MODEL, PD, PDFactory, metric_value, stream_raw
from .test_proxy_failures import assert_openai_error, raw_post
from .test_proxy_misc import cli_proxy

pytestmark = pytest.mark.timeout(30)

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def post(pd: PD, body: dict | None = None, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(pd.url + path, json=body or BODY, timeout=10)


def requests_total(pd: PD, url: str, outcome: str) -> float | None:
    return metric_value(
        pd.metrics(),
        "pdserve:proxy_requests_total",
        pool="colocated",
        instance=url,
        outcome=outcome,
    )


# -- load and health --------------------------------------------------------------------


def test_requests_spread_over_two_replicas_by_load(make_colocated: PDFactory) -> None:
    pd = make_colocated(2, knobs={"delay": 0.3})
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(post, pd) for _ in range(4)]
        # while all four are in flight, each replica holds two of them
        assert wait_until(lambda: sum(len(f.seen) for f in pd.colocated) == 4)
        assert [i.in_flight for i in pd.core.answer.instances] == [2, 2]
        assert all(f.result().status_code == 200 for f in futs)
    assert [len(f.seen) for f in pd.colocated] == [2, 2]
    assert [i.in_flight for i in pd.core.answer.instances] == [0, 0]
    for _ in range(2):  # sequential requests alternate (ties broken round-robin)
        assert post(pd).status_code == 200
    assert [len(f.seen) for f in pd.colocated] == [3, 3]


def test_a_busy_replica_gets_no_new_request(make_colocated: PDFactory) -> None:
    pd = make_colocated(2, knobs=[{"num_chunks": 20, "chunk_delay": 0.05}, {}])
    body = dict(BODY, stream=True, max_tokens=20)
    with httpx.Client(timeout=10) as c, c.stream("POST", pd.url + "/v1/completions", json=body):
        # one long stream holds replica 0; the next two requests both go to replica 1
        assert wait_until(lambda: pd.core.answer.instances[0].in_flight == 1)
        for _ in range(2):
            assert post(pd).status_code == 200
        assert [len(f.seen) for f in pd.colocated] == [1, 2]


def test_a_down_replica_is_skipped(make_colocated: PDFactory) -> None:
    pd = make_colocated(2, knobs=[{"health_status": 503}, {}])
    a, b = pd.colocated
    for _ in range(3):
        assert post(pd).status_code == 200
    assert (len(a.seen), len(b.seen)) == (0, 3)
    r = httpx.get(pd.url + "/health", timeout=5)
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "colocated": {"healthy": 1, "total": 2}}
    text = pd.metrics()
    healthy = "pdserve:proxy_instance_healthy"
    assert metric_value(text, healthy, pool="colocated", instance=a.url) == 0
    assert metric_value(text, healthy, pool="colocated", instance=b.url) == 1
    # a comes back, b goes: the next probe round moves the traffic
    a.health_status, b.health_status = 200, 503
    pd.loop.call(pd.proxy.app.state.health.check_all())
    assert post(pd).status_code == 200
    assert (len(a.seen), len(b.seen)) == (1, 3)
    # none left: the proxy says so
    a.health_status = 503
    pd.loop.call(pd.proxy.app.state.health.check_all())
    assert httpx.get(pd.url + "/health", timeout=5).status_code == 503


def test_no_healthy_replica_is_503(make_colocated: PDFactory) -> None:
    pd = make_colocated(2, knobs={"health_status": 503}, queue_timeout=0)
    err = assert_openai_error(post(pd), 503)
    assert "no healthy colocated instance (0 of 2 healthy)" in err["message"]
    assert metric_value(pd.metrics(), "pdserve:proxy_no_healthy_instance_total", pool="colocated")
    assert assert_openai_error(httpx.get(pd.url + "/v1/models", timeout=5), 503)
    r = httpx.get(pd.url + "/health", timeout=5)
    assert r.status_code == 503 and "colocated" in r.json()["error"]["message"]


# -- retries ----------------------------------------------------------------------------

FAILURES = {
    "status500": ({"fail_status": 500}, False, "server_error"),
    "refused": ({}, False, "connection_error"),
    "dropped": ({"drop": True}, False, "connection_error"),
    "timeout": ({"delay": 3.0}, False, "timeout"),
    "stream_broke_before_first_chunk": ({"break_after": 0}, True, "connection_error"),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failure_before_the_first_byte_is_retried_once_elsewhere(
    make_colocated: PDFactory, failure: str
) -> None:
    knobs, stream, outcome = FAILURES[failure]
    pd = make_colocated(2, knobs=[knobs, {}], request_timeout=0.5)
    bad, good = pd.colocated
    if failure == "refused":
        pd.stop_upstream(bad)  # still "healthy" for the proxy until the next probe
    body = dict(BODY, stream=stream)
    with httpx.Client(timeout=10) as c:
        r = c.post(pd.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        assert r.content == b"".join(good.sent_bytes)
    else:
        assert r.json()["choices"][0]["text"] == "t0t1t2t3"
    assert len(good.seen) == 1 and good.completed == 1
    assert metric_value(pd.metrics(), "pdserve:proxy_retries_total", pool="colocated") == 1
    assert requests_total(pd, bad.url, outcome) == 1
    assert requests_total(pd, good.url, "success") == 1


def test_failing_everywhere_returns_the_last_error_after_one_retry(
    make_colocated: PDFactory,
) -> None:
    pd = make_colocated(3, knobs={"fail_status": 503})
    err = assert_openai_error(post(pd), 503)
    assert err["message"] == "fake colocated failure"
    assert sorted(len(f.seen) for f in pd.colocated) == [0, 1, 1]  # one retry, no more


def test_a_4xx_is_returned_as_is_and_not_retried(make_colocated: PDFactory) -> None:
    pd = make_colocated(2, knobs=[{"fail_status": 400}, {}])
    err = assert_openai_error(post(pd), 400)
    assert err["message"] == "fake colocated failure"
    assert [len(f.seen) for f in pd.colocated] == [1, 0]
    assert metric_value(pd.metrics(), "pdserve:proxy_retries_total", pool="colocated") == 0


def test_a_stream_that_broke_after_its_first_chunk_is_not_retried(
    make_colocated: PDFactory,
) -> None:
    pd = make_colocated(2, knobs=[{"num_chunks": 6, "break_after": 2}, {}])
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="k", max_retries=0, timeout=10)
    texts: list[str] = []
    with pytest.raises(openai.APIError, match="colocated stream"):
        for chunk in client.completions.create(model=MODEL, prompt="hi", stream=True):
            texts.extend(c.text for c in chunk.choices)
    assert texts == ["t0", "t1"]
    assert pd.colocated[1].seen == []
    assert pd.core.answer.instances[0].failures == 1  # one failure: not marked down


def test_client_disconnect_aborts_the_upstream_request(make_colocated: PDFactory) -> None:
    pd = make_colocated(1, knobs={"num_chunks": 200, "chunk_delay": 0.02})
    sock = raw_post(pd.url, dict(BODY, stream=True), "gone-1")
    try:
        assert sock.recv(100)  # the stream is running
    finally:
        sock.close()
    fake = pd.colocated[0]
    assert wait_until(lambda: fake.disconnects == 1, 5)
    assert fake.completed == 0
    assert wait_until(lambda: requests_total(pd, fake.url, "client_disconnect") == 1, 5)
    assert pd.core.answer.instances[0].in_flight == 0


# -- what the instance gets, what the client gets --------------------------------------


def test_body_goes_whole_without_kv_transfer_params(make_colocated: PDFactory) -> None:
    pd = make_colocated(1)
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 7,
        "n": 2,
        "prompt_logprobs": 1,  # fine here: the instance computes the prompt itself
        "stream": False,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.1"},
    }
    r = httpx.post(pd.url + "/v1/completions", json=body, headers={"X-Request-Id": "c-1"})
    assert r.status_code == 200, r.text
    (seen,) = pd.colocated[0].seen
    assert seen.body == {k: v for k, v in body.items() if k != "kv_transfer_params"}
    assert seen.kv is None
    assert seen.headers["x-request-id"] == "c-1" == r.headers["x-request-id"]


def test_stream_is_byte_exact_and_not_buffered(make_colocated: PDFactory) -> None:
    pd = make_colocated(1, knobs={"num_chunks": 6, "chunk_delay": 0.15})
    received, arrivals = stream_raw(pd.url, dict(BODY, max_tokens=6, stream=True))
    assert received == b"".join(pd.colocated[0].sent_bytes)
    assert received.endswith(b"data: [DONE]\n\n")
    assert len(arrivals) >= 3 and arrivals[0] < arrivals[-1] - 0.4


def test_chat_streaming_and_non_streaming(make_colocated: PDFactory) -> None:
    pd = make_colocated(2, knobs={"num_chunks": 5})
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="k", max_retries=0, timeout=10)
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)  # type: ignore[arg-type]
    assert out.choices[0].message.content == "t0t1t2t3t4"
    texts: list[str] = []
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        texts.extend(c.delta.content or "" for c in chunk.choices)
    assert texts == [f"t{i}" for i in range(5)]
    seen = [s for f in pd.colocated for s in f.seen]
    assert {s.path for s in seen} == {"/v1/chat/completions"}
    assert sorted(s.body.get("stream", False) for s in seen) == [False, True]
    text = pd.metrics()
    ttft = "pdserve:proxy_time_to_first_token_seconds_count"
    counts = [metric_value(text, ttft, decode_instance=f.url) for f in pd.colocated]
    assert sum(c or 0 for c in counts) == 2
    tpot = "pdserve:proxy_time_per_output_token_seconds_count"
    assert sum(metric_value(text, tpot, decode_instance=f.url) or 0 for f in pd.colocated) == 1


def test_responses_api_is_forwarded(make_colocated: PDFactory) -> None:
    pd = make_colocated(1, knobs={"num_chunks": 3})
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3}
    r = post(pd, body, "/v1/responses")
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == "t0t1t2"
    with (
        httpx.Client(timeout=10) as c,
        c.stream("POST", pd.url + "/v1/responses", json=dict(body, stream=True)) as s,
    ):
        received = s.read()
    fake = pd.colocated[0]
    assert received == b"".join(fake.sent_bytes)
    assert b"response.output_text.delta" in received
    assert [s.path for s in fake.seen] == ["/v1/responses"] * 2
    ttft = "pdserve:proxy_time_to_first_token_seconds_count"
    assert metric_value(pd.metrics(), ttft, decode_instance=fake.url) == 2


def test_models_health_version_and_metrics(make_colocated: PDFactory) -> None:
    pd = make_colocated(2)
    r = httpx.get(pd.url + "/v1/models", timeout=5)
    assert r.status_code == 200
    assert r.json()["data"][0]["owned_by"] == "colocated"
    r = httpx.get(pd.url + "/health", timeout=5)
    assert r.json() == {"status": "ok", "colocated": {"healthy": 2, "total": 2}}
    assert httpx.get(pd.url + "/version", timeout=5).json()["version"]
    assert post(pd).status_code == 200
    text = pd.metrics()
    for f in pd.colocated:
        labels = {"pool": "colocated", "instance": f.url}
        assert metric_value(text, "pdserve:proxy_in_flight_requests", **labels) == 0
        assert metric_value(text, "pdserve:proxy_instance_healthy", **labels) == 1
        ttft = "pdserve:proxy_time_to_first_token_seconds_count"
        assert metric_value(text, ttft, pool="pdserve", decode_instance=f.url) is not None
    assert sum(requests_total(pd, f.url, "success") or 0 for f in pd.colocated) == 1
    assert metric_value(text, "pdserve:proxy_retries_total", pool="colocated") == 0
    assert 'pool="prefill"' not in text and 'pool="decode"' not in text
    assert "pdserve:proxy_prefill_leg_seconds_count" not in text


def test_api_key_is_required_and_forwarded(make_colocated: PDFactory) -> None:
    pd = make_colocated(1, api_key="sekrit")
    assert post(pd).status_code == 401
    assert httpx.get(pd.url + "/v1/models", timeout=5).status_code == 401
    r = httpx.post(
        pd.url + "/v1/completions",
        json=BODY,
        headers={"Authorization": "Bearer sekrit"},
        timeout=10,
    )
    assert r.status_code == 200
    assert pd.colocated[0].seen[0].headers["authorization"] == "Bearer sekrit"


# -- building it ------------------------------------------------------------------------


def test_mixing_pools_is_refused_and_no_secret_is_needed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="--colocated cannot be combined with --prefill/--decode"):
        build_proxy_app(["h:1"], ["h:2"], colocated_urls=["h:3"])
    with pytest.raises(ValueError, match="--colocated cannot be combined"):
        build_proxy_app([], ["h:2"], colocated_urls=["h:3"])
    with pytest.raises(ValueError, match=r"no instances: give --prefill URL\.\.\. and --decode"):
        build_proxy_app()
    with pytest.raises(ValueError, match="--colocated: http://h:1 is listed twice"):
        build_proxy_app(colocated_urls=["h:1", "http://h:1"])
    monkeypatch.delenv(SECRET_ENV)
    app = build_proxy_app(colocated_urls=["h:1", "h:2"])  # signs nothing: no secret needed
    assert [p.role for p in app.state.proxy.pools] == ["colocated"]
    with pytest.raises(ValueError, match=SECRET_ENV):
        build_proxy_app(["h:1"], ["h:2"])
    parser = argparse.ArgumentParser()
    proxy_mod.add_cli_args(parser)
    args = parser.parse_args(["--colocated", "h:1", "--decode", "h:2"])
    assert proxy_mod.main(args) == 2
    assert "--colocated cannot be combined" in capsys.readouterr().err
    assert proxy_mod.main(parser.parse_args([])) == 2
    assert "no instances" in capsys.readouterr().err


def test_cli_colocated_serves_and_stops(make_colocated: PDFactory, tmp_path: Path) -> None:
    fakes = make_colocated(2)
    args = ["--colocated", *(f.url for f in fakes.colocated), "--health-interval", "0.5"]
    with cli_proxy(args, tmp_path / "log") as (proc, url):
        for _ in range(2):
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 200
        assert [len(f.seen) for f in fakes.colocated] == [1, 1]
        health = httpx.get(url + "/health", timeout=5).json()
        assert health["colocated"] == {"healthy": 2, "total": 2}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, (tmp_path / "log").read_text()
