"""Failure paths: retries, 4xx, missing KV params, unhealthy pools, client disconnects."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from _polling import wait_until

from .conftest import MODEL, PD, PDFactory, metric_value

pytestmark = pytest.mark.timeout(30)

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def post(pd: PD, body: dict | None = None, **kw: object) -> httpx.Response:
    return httpx.post(pd.url + "/v1/completions", json=body or BODY, timeout=10, **kw)  # type: ignore[arg-type]


def raw_post(url: str, body: dict, request_id: str) -> socket.socket:
    """Send a request on a raw socket (the test decides when to hang up)."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    s = socket.create_connection((parts.hostname, parts.port), timeout=5)
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    return err


# -- prefill retries ------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["status500", "refused", "dropped", "timeout"])
def test_prefill_failure_is_retried_on_the_other_instance(make_pd: PDFactory, failure: str) -> None:
    knobs = {
        "status500": {"fail_status": 500},
        "refused": {},
        "dropped": {"drop": True},
        "timeout": {"delay": 3.0},
    }[failure]
    pd = make_pd(2, 1, prefill_knobs=[knobs, {}], request_timeout=0.5)
    bad, good = pd.prefill
    if failure == "refused":
        pd.stop_upstream(bad)  # still "healthy" for the proxy until the next poll
    r = post(pd)
    assert r.status_code == 200, r.text
    assert len(good.seen) == 1 and len(pd.decode[0].seen) == 1
    assert pd.decode[0].seen[0].kv == good.kv_params(r.headers["x-request-id"])
    text = pd.metrics()
    assert metric_value(text, "pdserve:proxy_retries_total", pool="prefill") == 1
    outcome = {
        "status500": "server_error",
        "refused": "connection_error",
        "dropped": "connection_error",
        "timeout": "timeout",
    }[failure]
    assert (
        metric_value(
            text, "pdserve:proxy_requests_total", pool="prefill", instance=bad.url, outcome=outcome
        )
        == 1
    )
    # a connection error is one failure; one alone does not take the instance out
    inst = pd.core.prefill.instances[0]
    assert inst.healthy is True
    assert inst.failures == (1 if outcome == "connection_error" else 0)


def test_prefill_failing_everywhere_returns_the_last_error(make_pd: PDFactory) -> None:
    pd = make_pd(2, 1, prefill_knobs={"fail_status": 503})
    r = post(pd)
    err = assert_openai_error(r, 503)
    assert err["message"] == "fake prefill failure"
    assert [len(f.seen) for f in pd.prefill] == [1, 1]  # one retry, no more
    assert pd.decode[0].seen == []


def test_single_prefill_connection_error_is_502(make_pd: PDFactory) -> None:
    """A refused connection waits (queue_timeout) for the instance to come back, then is
    502; the third consecutive failure marks the instance down, and then it is 503."""
    pd = make_pd(1, 1, queue_timeout=0.3)
    pd.stop_upstream(pd.prefill[0])
    inst = pd.core.prefill.instances[0]
    for n in (1, 2, 3):
        err = assert_openai_error(post(pd), 502)
        assert "prefill" in err["message"] and "connection_error" in err["message"]
        assert inst.failures == n and inst.healthy is (n < 3)
    assert_openai_error(post(pd), 503)  # now known to be down


def test_prefill_4xx_is_returned_as_is_and_not_retried(make_pd: PDFactory) -> None:
    pd = make_pd(2, 1, prefill_knobs=[{"fail_status": 400}, {}])
    r = post(pd)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "fake prefill failure"
    assert [len(f.seen) for f in pd.prefill] == [1, 0]
    assert pd.decode[0].seen == []
    assert metric_value(pd.metrics(), "pdserve:proxy_retries_total", pool="prefill") == 0


def test_missing_kv_params_is_counted_logged_and_forwarded(
    make_pd: PDFactory, caplog: pytest.LogCaptureFixture
) -> None:
    pd = make_pd(prefill_knobs={"missing_params": True})
    with caplog.at_level(logging.WARNING, logger="pdserve.serving.proxy.forward"):
        r = post(pd, dict(BODY, kv_transfer_params={"bogus": 1}), headers={"X-Request-Id": "r-7"})
    assert r.status_code == 200
    assert "kv_transfer_params" not in pd.decode[0].seen[0].body
    value = metric_value(
        pd.metrics(),
        "pdserve:proxy_prefill_missing_kv_params_total",
        prefill_instance=pd.prefill[0].url,
    )
    assert value == 1
    assert any(
        "r-7" in rec.getMessage() and "kv_transfer_params" in rec.getMessage()
        for rec in caplog.records
        if rec.levelno == logging.WARNING
    )


# -- health -----------------------------------------------------------------------------


@pytest.mark.parametrize("down", ["prefill", "decode"])
def test_503_when_a_pool_has_no_healthy_instance(make_pd: PDFactory, down: str) -> None:
    knobs = {"health_status": 503}
    pd = make_pd(
        prefill_knobs=knobs if down == "prefill" else None,
        decode_knobs=knobs if down == "decode" else None,
        queue_timeout=0.5,
    )
    t0 = time.monotonic()
    err = assert_openai_error(post(pd), 503)
    assert 0.5 <= time.monotonic() - t0 < 5  # it waited queue_timeout for an instance
    assert down in err["message"]
    assert err["type"] == "ServiceUnavailableError"
    assert pd.prefill[0].seen == [] and pd.decode[0].seen == []
    assert_openai_error(httpx.get(pd.url + "/health", timeout=5), 503)


def test_health_polling_tracks_instances(make_pd: PDFactory) -> None:
    pd = make_pd(2, 1, health_interval=0.05)
    assert httpx.get(pd.url + "/health", timeout=5).json()["prefill"] == {"healthy": 2, "total": 2}
    pd.prefill[0].health_status = 500
    assert wait_until(lambda: not pd.core.prefill.instances[0].healthy)
    for _ in range(3):
        assert post(pd).status_code == 200
    assert [len(f.seen) for f in pd.prefill] == [0, 3]  # unhealthy instances are skipped
    pd.prefill[1].health_status = 500
    assert wait_until(lambda: httpx.get(pd.url + "/health", timeout=5).status_code == 503)
    pd.prefill[0].health_status = 200
    assert wait_until(lambda: httpx.get(pd.url + "/health", timeout=5).status_code == 200)
    assert post(pd).status_code == 200
    assert len(pd.prefill[0].seen) == 1


# -- client disconnects and KV release --------------------------------------------------


def test_disconnect_mid_stream_aborts_decode_and_releases(make_pd: PDFactory) -> None:
    pd = make_pd(decode_knobs={"num_chunks": 400, "chunk_delay": 0.01})
    s = raw_post(pd.url, dict(BODY, stream=True), "rid-mid-stream")
    got = b""
    while got.count(b"data: ") < 2:
        got += s.recv(65536)
    assert b" 200 " in got.split(b"\r\n", 1)[0]
    s.close()
    fake_d, fake_p = pd.decode[0], pd.prefill[0]
    assert wait_until(lambda: fake_d.disconnects == 1), "decode did not see the disconnect"
    assert fake_d.completed == 0
    assert wait_until(lambda: fake_p.releases == [{"request_id": "rid-mid-stream"}])
    assert fake_p.release_headers[0]["x-request-id"] == "rid-mid-stream"
    assert wait_until(lambda: pd.core.decode.instances[0].in_flight == 0)
    text = pd.metrics()
    labels = {"prefill_instance": fake_p.url, "reason": "client_disconnect"}
    assert metric_value(text, "pdserve:proxy_kv_released_total", **labels) == 1
    assert (
        metric_value(
            text,
            "pdserve:proxy_requests_total",
            pool="decode",
            instance=fake_d.url,
            outcome="client_disconnect",
        )
        == 1
    )


def test_disconnect_after_prefill_releases_kv(make_pd: PDFactory) -> None:
    pd = make_pd(decode_knobs={"delay": 10.0}, prefill_knobs={"release_status": 404})
    s = raw_post(pd.url, BODY, "rid-after-prefill")
    fake_d, fake_p = pd.decode[0], pd.prefill[0]
    assert wait_until(lambda: len(fake_d.seen) == 1)  # prefill done, decode leg running
    s.close()
    assert wait_until(lambda: fake_d.disconnects == 1), "decode leg was not aborted"
    assert wait_until(lambda: fake_p.releases == [{"request_id": "rid-after-prefill"}])
    fake_d.delay = 0.0
    assert post(pd).status_code == 200  # the 404 from the release call was ignored


def test_disconnect_during_prefill_aborts_it_without_release(make_pd: PDFactory) -> None:
    pd = make_pd(prefill_knobs={"delay": 10.0})
    s = raw_post(pd.url, BODY, "rid-in-prefill")
    fake_p = pd.prefill[0]
    assert wait_until(lambda: len(fake_p.seen) == 1)
    s.close()
    assert wait_until(lambda: fake_p.disconnects == 1), "prefill leg was not aborted"
    assert wait_until(lambda: pd.core.prefill.instances[0].in_flight == 0)
    assert fake_p.releases == [] and pd.decode[0].seen == []


def test_decode_connection_error_releases_and_is_503(make_pd: PDFactory) -> None:
    """A decode leg that cannot connect does not wait for its instance holding the KV:
    the KV is released at once; the request waits for a decode instance as a new one
    does (queue_timeout), and with none, is 503."""
    pd = make_pd(queue_timeout=0.5)
    pd.stop_upstream(pd.decode[0])
    t0 = time.monotonic()
    r = post(pd, headers={"X-Request-Id": "rid-d-down"})
    err = assert_openai_error(r, 503)
    assert "decode" in err["message"] and time.monotonic() - t0 < 5
    assert pd.prefill[0].releases == [{"request_id": "rid-d-down"}]  # before the wait
    assert pd.core.decode.instances[0].failures == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_that_dies_under_a_request_is_replaced_by_a_new_prefill(
    make_pd: PDFactory, stream: bool
) -> None:
    """The decode instance drops the request's connection (as a killed process does):
    the KV it was given is released and the request runs again, re-prefilled (fresh
    params), on the other decode instance; no leg is re-sent with the first params."""
    pd = make_pd(1, 2, decode_knobs=[{"drop": True}, {}])
    dead, alive = pd.decode
    pd.core.decode.instances[1].in_flight = 1  # the dead one is picked first
    r = post(pd, dict(BODY, stream=stream), headers={"X-Request-Id": "rid-redo"})
    pd.core.decode.instances[1].in_flight = 0
    assert r.status_code == 200, r.text
    assert len(pd.prefill[0].seen) == 2 and len(alive.seen) == 1
    first, second = (s.body["kv_transfer_params"] for s in pd.prefill[0].seen)
    assert first["pd_nonce"] != second["pd_nonce"]
    # (a pooled connection that broke is retried once on a new one, signed afresh)
    sent = [s.body["kv_transfer_params"] for s in dead.seen + alive.seen]
    assert len({kv["pd_nonce"] for kv in sent}) == len(sent)
    assert {s.kv["remote_request_id"] for s in dead.seen + alive.seen if s.kv} == {"rid-redo"}
    assert pd.prefill[0].releases == [{"request_id": "rid-redo"}]  # the first KV only
    text = pd.metrics()
    assert metric_value(text, "pdserve:proxy_retries_total", pool="decode") == 1


def test_a_decode_that_dies_with_no_other_is_503(make_pd: PDFactory) -> None:
    pd = make_pd(decode_knobs={"drop": True}, queue_timeout=0.5)
    t0 = time.monotonic()
    r = post(pd, headers={"X-Request-Id": "rid-dead"})
    err = assert_openai_error(r, 503)
    assert "failed under this request" in err["message"] and time.monotonic() - t0 < 2
    assert len(pd.prefill[0].seen) == 1  # not prefilled again for nobody
    assert wait_until(lambda: pd.prefill[0].releases == [{"request_id": "rid-dead"}])


def test_a_request_whose_decode_died_runs_again_once_the_decode_is_back(
    make_pd: PDFactory,
) -> None:
    """1P1D, the decode dies under a request and is restarted (the probes see it go
    and come back): the request's KV is released at once, and the request waits for the
    new decode and completes there, re-prefilled; nothing waits on the first KV."""
    pd = make_pd(decode_knobs={"drop": True}, queue_timeout=10)
    fake, pool = pd.decode[0], pd.core.decode
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(post, pd, None, headers={"X-Request-Id": "rid-back"})
        assert wait_until(lambda: pd.prefill[0].releases == [{"request_id": "rid-back"}])
        assert not fut.done() and len(pd.prefill[0].seen) == 1
        fake.drop = False

        async def restarted() -> None:
            pool.set_healthy(pool.instances[0], False, "killed")
            pool.set_healthy(pool.instances[0], True)

        pd.loop.call(restarted())
        r = fut.result(10)
    assert r.status_code == 200, r.text
    assert len(pd.prefill[0].seen) == 2 and fake.completed == 1


def test_decode_error_status_is_returned_and_releases(make_pd: PDFactory) -> None:
    pd = make_pd(decode_knobs={"fail_status": 500})
    r = post(pd, dict(BODY, stream=True), headers={"X-Request-Id": "rid-d-500"})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "fake decode failure"
    assert wait_until(lambda: pd.prefill[0].releases == [{"request_id": "rid-d-500"}])


def test_unexpected_proxy_error_is_500_and_releases(
    make_pd: PDFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.serving.proxy.forward import ProxyResponse

    async def boom(self: ProxyResponse, *args: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(ProxyResponse, "_answer_leg", boom)
    pd = make_pd()
    r = post(pd, headers={"X-Request-Id": "rid-bug"})
    assert_openai_error(r, 500)
    assert wait_until(lambda: pd.prefill[0].releases == [{"request_id": "rid-bug"}])
    labels = {"prefill_instance": pd.prefill[0].url, "reason": "proxy_error"}
    assert metric_value(pd.metrics(), "pdserve:proxy_kv_released_total", **labels) == 1
