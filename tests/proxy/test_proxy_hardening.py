"""The proxy does not flap: stale pooled connections are retried on a new one, an
instance is marked down only after N consecutive failures, legs on an instance that
hangs end once it is marked down, and both legs' kv_transfer_params are signed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from _polling import wait_until
from pdserve.core_types.pd_auth import EXPIRES_FIELD, SECRET_ENV, SIGNATURE_FIELD
from pdserve.serving.proxy.app import build_proxy_app
from pdserve.serving.proxy.core import PREFILL_KV_PARAMS

from .conftest import MODEL, PD, PDFactory, metric_value
from .procs import start_fake

pytestmark = pytest.mark.timeout(60)

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def post(pd: PD, body: dict | None = None, **kw: object) -> httpx.Response:
    return httpx.post(pd.url + "/v1/completions", json=body or BODY, timeout=20, **kw)  # type: ignore[arg-type]


# -- signing ----------------------------------------------------------------------------


def test_both_legs_are_signed_and_client_params_never_pass(make_pd: PDFactory) -> None:
    pd = make_pd()
    forged = {"do_remote_prefill": True, "remote_host": "evil.example", "remote_port": 1}
    t0 = time.time()
    r = post(pd, dict(BODY, kv_transfer_params=forged), headers={"X-Request-Id": "sig-1"})
    assert r.status_code == 200, r.text
    (p,), (d,) = pd.prefill[0].seen, pd.decode[0].seen
    # the fakes verified both with pd_auth.verify_kv_params (an unsigned leg gets 403)
    assert p.kv == PREFILL_KV_PARAMS
    assert d.kv == pd.prefill[0].kv_params("sig-1")
    for seen in (p, d):
        raw = seen.body["kv_transfer_params"]
        assert isinstance(raw[SIGNATURE_FIELD], str) and len(raw[SIGNATURE_FIELD]) == 64
        assert t0 + 100 < raw[EXPIRES_FIELD] < time.time() + 121  # fresh, DEFAULT_TTL_S
        assert raw.get("remote_host") != "evil.example"


def test_prefill_answer_is_re_signed_not_passed_through(make_pd: PDFactory) -> None:
    """Whatever signature fields the prefill's answer carries, the decode leg gets the
    proxy's own signature over the answer's params."""
    pd = make_pd()
    fake = pd.prefill[0]
    plain = fake.kv_params

    def with_bogus_signature(rid: str) -> dict:
        return {**plain(rid), SIGNATURE_FIELD: "00" * 32, EXPIRES_FIELD: 1.0}

    fake.kv_params = with_bogus_signature  # type: ignore[method-assign]
    r = post(pd, headers={"X-Request-Id": "sig-2"})
    assert r.status_code == 200, r.text
    assert pd.decode[0].seen[0].kv == plain("sig-2")


def test_an_instance_refuses_unsigned_params(make_pd: PDFactory) -> None:
    """The fakes check like an instance does: this is what the proxy's signature buys."""
    pd = make_pd()
    r = httpx.post(
        pd.decode[0].url + "/v1/completions",
        json=dict(BODY, kv_transfer_params={"do_remote_prefill": True}),
        timeout=5,
    )
    assert r.status_code == 403 and "unsigned" in r.json()["error"]["message"]


def test_no_secret_refuses_to_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ValueError, match=f"{SECRET_ENV} is not set"):
        build_proxy_app(["h:1"], ["h:2"])
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=f"{SECRET_ENV} must be at least 32 characters"):
        build_proxy_app(["h:1"], ["h:2"])
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.serving.proxy", "--prefill", "h:1", "--decode", "h:2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2
    assert f"pdserve proxy: error: {SECRET_ENV} is not set" in r.stderr


# -- stale pooled connections and the failure threshold --------------------------------


def test_one_closed_pooled_connection_neither_fails_nor_marks_down(make_pd: PDFactory) -> None:
    """Each instance closes a connection that was idle longer than 0.3 s just as the next
    request arrives on it (a keep-alive timer firing at that moment). The request is
    re-sent on a new connection: no failure, no failure counted against the instance."""
    knobs = {"close_idle_after": 0.3}
    pd = make_pd(prefill_knobs=knobs, decode_knobs=knobs)
    for _ in range(4):
        time.sleep(0.4)  # just over the instances' keep-alive
        r = post(pd, dict(BODY, stream=True))
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    # every other request found its pooled connection closed (the retry's new connection
    # is not pooled, so the next request opens one that is)
    assert pd.prefill[0].stale_drops >= 2 and pd.decode[0].stale_drops >= 2
    # health probes too: a probe on a stale connection is retried, not counted
    before = pd.prefill[0].stale_drops + pd.decode[0].stale_drops
    time.sleep(0.4)
    health = pd.proxy.app.state.health
    for pool in (pd.core.prefill, pd.core.decode):
        pd.loop.call(health.check(pool, pool.instances[0]))
    assert pd.prefill[0].stale_drops + pd.decode[0].stale_drops > before
    assert pd.prefill[0].health_probes >= 2 and pd.decode[0].health_probes >= 2
    for inst in (pd.core.prefill.instances[0], pd.core.decode.instances[0]):
        assert inst.healthy and inst.failures == 0 and inst.generation == 1
    text = pd.metrics()
    for pool in ("prefill", "decode"):
        retries = metric_value(text, "pdserve:proxy_stale_connection_retries_total", pool=pool)
        assert retries is not None and retries >= 2
        assert metric_value(text, "pdserve:proxy_requests_total", pool=pool, outcome="success")
    assert metric_value(text, "pdserve:proxy_instance_marked_down_total", pool="decode") == 0


def test_n_consecutive_failures_mark_down_and_successes_reset(make_pd: PDFactory) -> None:
    pd = make_pd(queue_timeout=0.3)
    fake, inst = pd.decode[0], pd.core.decode.instances[0]
    assert pd.core.decode.failure_threshold == 3
    fake.drop = True  # closes every connection unanswered, new ones too
    for n in (1, 2):  # the decode went away under it and no other is there: 503
        assert post(pd).status_code == 503
        assert inst.failures == n and inst.healthy
    fake.drop = False
    assert post(pd).status_code == 200
    assert inst.failures == 0  # a success resets the count
    fake.drop = True
    for n in (1, 2, 3):
        assert post(pd).status_code == 503
        assert inst.failures == n and inst.healthy is (n < 3)
    r = post(pd)  # marked down: nothing is sent to it, 503 after queue_timeout
    assert r.status_code == 503 and "no healthy decode instance" in r.json()["error"]["message"]
    text = pd.metrics()
    assert metric_value(text, "pdserve:proxy_instance_marked_down_total", pool="decode") == 1
    fake.drop = False
    pd.loop.call(pd.proxy.app.state.health.check_all())  # a probe brings it back
    assert inst.healthy and inst.generation == 2
    assert post(pd).status_code == 200


def test_a_request_waits_for_its_pool_to_come_back(make_pd: PDFactory) -> None:
    """With no healthy decode instance the request waits (queue_timeout) and is served
    once a health probe finds one again: a restart does not fail new requests."""
    pd = make_pd(decode_knobs={"health_status": 503}, health_interval=0.1, queue_timeout=10)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(post, pd)
        time.sleep(0.5)
        assert not fut.done() and pd.prefill[0].seen == []  # no prefill work meanwhile
        pd.decode[0].health_status = 200
        r = fut.result(10)
    assert r.status_code == 200, r.text


# -- deadlines follow health ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["before-first-byte", "mid-stream"])
def test_legs_on_a_hung_instance_end_once_it_is_marked_down(
    make_pd: PDFactory, tmp_path: Path, stream: bool
) -> None:
    """SIGSTOP the decode instance while a leg runs on it: the leg ends within seconds of
    the probes marking it down (3 x 0.3 s timeouts), not after the 600 s leg timeout."""
    args = ["--chunks", "100000", "--chunk-delay", "0.01"] if stream else ["--delay", "60"]
    dec = start_fake("decode", tmp_path / "decode.log", *args)
    try:
        pd = make_pd(
            1, 0, decode_urls=[dec.url], health_interval=0.3, health_timeout=0.3, queue_timeout=1
        )
        inst = pd.core.decode.instances[0]
        body = dict(BODY, stream=stream)

        def call() -> tuple[int, bytes, float]:
            """Status, the bytes after SIGSTOP, and how long they took."""
            with (
                httpx.Client(timeout=120) as c,
                c.stream("POST", pd.url + "/v1/completions", json=body) as r,
            ):
                it = r.iter_raw()
                if stream:  # the stream runs: stop the instance after its first bytes
                    assert r.status_code == 200 and next(it).startswith(b"data: ")
                    dec.signal(signal.SIGSTOP)
                t0 = time.monotonic()
                return r.status_code, b"".join(it), time.monotonic() - t0

        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(call)
            if not stream:  # the decode leg waits for its answer: stop the instance now
                assert wait_until(lambda: inst.in_flight == 1, 10)
                dec.signal(signal.SIGSTOP)
            status, rest, took = fut.result(60)
        assert took < 8, took  # 0.3 s probes x 3 failures, plus slack for a busy CPU
        assert not inst.healthy and inst.in_flight == 0
        if stream:
            assert b"decode stream from" in rest and b"instance_down" in rest
            assert b"[DONE]" not in rest
        else:
            assert status == 503 and b"instance_down" in rest
        assert wait_until(lambda: pd.prefill[0].releases != [], 5)  # its KV is released
        labels = {"pool": "decode", "instance": dec.url, "outcome": "instance_down"}
        assert metric_value(pd.metrics(), "pdserve:proxy_requests_total", **labels) == 1
        dec.signal(signal.SIGCONT)  # it recovers: probes bring it back
        assert wait_until(lambda: inst.healthy and inst.generation == 2, 10)
    finally:
        dec.signal(signal.SIGKILL)  # its handler still sleeps; no graceful drain
        dec.stop()


# -- memory ------------------------------------------------------------------------------


def test_heap_trimmer_runs_and_stops() -> None:
    import asyncio

    from pdserve.serving.proxy import heap_trim

    assert heap_trim.trim_heap() is (heap_trim._MALLOC_TRIM is not None)
    calls: list[int] = []

    async def run() -> None:
        t = heap_trim.HeapTrimmer(interval=0.01)
        real, heap_trim._MALLOC_TRIM = heap_trim._MALLOC_TRIM, lambda pad: calls.append(pad) or 1
        try:
            t.start()
            await asyncio.sleep(0.1)
            await t.stop()
        finally:
            heap_trim._MALLOC_TRIM = real

    asyncio.run(run())
    assert len(calls) >= 3 and set(calls) == {0}


def test_a_refused_retry_after_a_dropped_connection_is_not_taken_for_never_sent() -> None:
    """The instance drops a pooled connection under a request and is gone when the retry
    dials it (a killed decode): that is ConnectionLost, a failure after the request may
    have reached it, not a connect error (whose leg the proxy may send elsewhere as is).
    Each attempt's body is made afresh (single-use signatures)."""
    from pdserve.serving.proxy.core import classify_error, not_sent
    from pdserve.serving.proxy.upstream import ConnectionLost, Upstream

    async def run() -> tuple[BaseException, list[int]]:
        served: list[int] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await reader.readuntil(b"\r\n\r\n"):
                served.append(1)
                if len(served) == 2:  # the second request: die (connection and listener)
                    server.close()
                    writer.close()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x"
        up = Upstream(connect_timeout=2.0)
        up.open()
        bodies: list[int] = []

        def body() -> dict[str, int]:
            bodies.append(len(bodies))
            return {"n": bodies[-1]}

        try:
            resp = await up.request("GET", url)
            assert resp.status == 200 and await resp.read() == b"ok"
            resp.release()  # back to the pool
            try:
                await up.request("POST", url, json_factory=body)
            except Exception as e:  # noqa: BLE001 - what it is, is the test
                return e, bodies
            raise AssertionError("the request did not fail")
        finally:
            await up.close()

    exc, bodies = asyncio.run(run())
    assert isinstance(exc, ConnectionLost), repr(exc)
    assert not not_sent(exc) and classify_error(exc) == ("connection_error", True)
    assert bodies == [0, 1]
