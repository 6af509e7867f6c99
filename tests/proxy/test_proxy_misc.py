"""Auth, /v1/models, /metrics, input checks, broken streams, the pool and SSE helpers,
and the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from _polling import wait_until
from pdserve.core_types.pd_auth import new_secret, verify_kv_params
from pdserve.serving.proxy import cli as proxy_mod
from pdserve.serving.proxy.app import build_proxy_app
from pdserve.serving.proxy.core import prefill_body
from pdserve.serving.proxy.pool import InstancePool, normalize_url, normalize_urls
from pdserve.serving.proxy.sse_meter import SSEMeter

from .conftest import MODEL, PDFactory, metric_value

pytestmark = pytest.mark.timeout(30)

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


# -- auth -------------------------------------------------------------------------------


def test_api_key_required_and_forwarded(make_pd: PDFactory) -> None:
    pd = make_pd(api_key="sekrit")
    url = pd.url + "/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        r = httpx.post(url, json=BODY, headers=headers, timeout=5)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(pd.url + "/v1/models", timeout=5).status_code == 401
    assert pd.prefill[0].seen == []
    # /health and /metrics stay open
    assert httpx.get(pd.url + "/health", timeout=5).status_code == 200
    assert httpx.get(pd.url + "/metrics", timeout=5).status_code == 200
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="sekrit", max_retries=0, timeout=10)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=4).choices
    assert pd.prefill[0].seen[0].headers["authorization"] == "Bearer sekrit"
    assert pd.decode[0].seen[0].headers["authorization"] == "Bearer sekrit"


def test_upstream_api_key_replaces_the_clients(make_pd: PDFactory) -> None:
    pd = make_pd(api_key="client-key", upstream_api_key="upstream-key")
    r = httpx.post(
        pd.url + "/v1/completions",
        json=BODY,
        headers={"Authorization": "Bearer client-key"},
        timeout=5,
    )
    assert r.status_code == 200
    assert pd.prefill[0].seen[0].headers["authorization"] == "Bearer upstream-key"
    assert pd.decode[0].seen[0].headers["authorization"] == "Bearer upstream-key"


# -- other routes and input checks ------------------------------------------------------


def test_models_come_from_a_decode_instance(make_pd: PDFactory) -> None:
    pd = make_pd()
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="k", max_retries=0, timeout=10)
    models = client.models.list()
    assert [(m.id, m.owned_by) for m in models.data] == [(MODEL, "decode")]


@pytest.mark.parametrize(
    ("content", "headers", "needle"),
    [
        (b"{not json", {}, "not valid JSON"),
        (b"[1, 2]", {}, "JSON object"),
        (json.dumps(dict(BODY, stream="yes")).encode(), {}, "stream"),
        (json.dumps(BODY).encode(), {"X-Request-Id": "has space"}, "X-Request-Id"),
        (json.dumps(dict(BODY, prompt_logprobs=2)).encode(), {}, "prompt_logprobs is not"),
        (json.dumps(dict(BODY, echo=True, logprobs=0)).encode(), {}, "echo=true with logprobs"),
    ],
)
def test_bad_requests_are_400(
    make_pd: PDFactory, content: bytes, headers: dict[str, str], needle: str
) -> None:
    pd = make_pd()
    r = httpx.post(
        pd.url + "/v1/completions",
        content=content,
        headers={"Content-Type": "application/json", **headers},
        timeout=5,
    )
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]
    assert pd.prefill[0].seen == []


def test_unknown_route_is_openai_404(make_pd: PDFactory) -> None:
    pd = make_pd()
    r = httpx.get(pd.url + "/v1/nope", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_broken_decode_stream_ends_with_an_error_event(make_pd: PDFactory) -> None:
    pd = make_pd(decode_knobs={"num_chunks": 6, "break_after": 2})
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="k", max_retries=0, timeout=10)
    texts: list[str] = []
    with pytest.raises(openai.APIError, match="decode stream"):
        for chunk in client.completions.create(
            model=MODEL,
            prompt="hi",
            max_tokens=6,
            stream=True,
            extra_headers={"X-Request-Id": "b1"},
        ):
            texts.extend(c.text for c in chunk.choices)
    assert texts == ["t0", "t1"]
    assert wait_until(lambda: pd.prefill[0].releases == [{"request_id": "b1"}])
    assert pd.core.decode.instances[0].failures == 1  # one failure: not marked down


# -- metrics ----------------------------------------------------------------------------


def test_metrics_series_and_sla_buckets(make_pd: PDFactory) -> None:
    pd = make_pd(decode_knobs={"num_chunks": 5, "chunk_delay": 0.01})
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="k", max_retries=0, timeout=10)
    list(client.completions.create(model=MODEL, prompt="hi", max_tokens=5, stream=True))
    client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
    r = httpx.get(pd.url + "/metrics", timeout=5)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    p_url, d_url = pd.prefill[0].url, pd.decode[0].url
    d = {"pool": "pdserve", "decode_instance": d_url}
    p = {"pool": "pdserve", "prefill_instance": p_url}
    for name, labels, count in [
        ("pdserve:proxy_time_to_first_token_seconds", d, 2),
        ("pdserve:proxy_time_per_output_token_seconds", d, 1),
        ("pdserve:proxy_prefill_leg_seconds", p, 2),
    ]:
        assert metric_value(text, name + "_count", **labels) == count, name
        for le in ("0.02", "2.5"):
            assert metric_value(text, name + "_bucket", le=le, **labels) is not None, (name, le)
    tpot_sum = metric_value(text, "pdserve:proxy_time_per_output_token_seconds_sum", **d)
    assert tpot_sum is not None and 0.005 < tpot_sum < 1.0
    for pool, url in (("prefill", p_url), ("decode", d_url)):
        req = metric_value(
            text, "pdserve:proxy_requests_total", pool=pool, instance=url, outcome="success"
        )
        assert req == 2
        assert metric_value(text, "pdserve:proxy_in_flight_requests", pool=pool, instance=url) == 0
        assert metric_value(text, "pdserve:proxy_instance_healthy", pool=pool, instance=url) == 1
    assert metric_value(text, "pdserve:proxy_retries_total", pool="prefill") == 0
    assert (
        metric_value(text, "pdserve:proxy_prefill_missing_kv_params_total", prefill_instance=p_url)
        == 0
    )
    assert "pdserve:proxy_kv_released_total" in text


def _spec_text(drafts: int, tokens: int, accepted: int) -> str:
    """An instance's /metrics with its spec-decode counters split over two engines."""
    lines = ["# TYPE pdserve:spec_decode_num_drafts_total counter"]
    for engine in ("0", "1"):
        for name, value in (
            ("num_drafts", drafts),
            ("num_draft_tokens", tokens),
            ("num_accepted_tokens", accepted),
        ):
            lines.append(f'pdserve:spec_decode_{name}_total{{engine="{engine}"}} {value / 2}')
    lines.append('pdserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 99')
    return "\n".join(lines) + "\n"


def test_spec_decode_per_pool(make_pd: PDFactory) -> None:
    """The proxy re-exports each instance's draft counters by pool and derives the pool's
    acceptance rate and mean acceptance length."""
    pd = make_pd(
        n_decode=2,
        prefill_knobs={"metrics_text": _spec_text(10, 10, 4)},  # k=1
        decode_knobs=[
            {"metrics_text": _spec_text(20, 60, 30)},  # k=3
            {"metrics_text": _spec_text(20, 60, 42)},
        ],
        spec_scrape_interval=0.1,
    )

    def text() -> str:
        return httpx.get(pd.url + "/metrics", timeout=5).text

    name = "pdserve:proxy_spec_decode_num_accepted_tokens_total"
    d0 = pd.decode[0].url
    assert wait_until(lambda: metric_value(text(), name, pool="decode", instance=d0) == 30, 5)
    t = text()
    p0 = pd.prefill[0].url
    assert (
        metric_value(t, "pdserve:proxy_spec_decode_num_drafts_total", pool="prefill", instance=p0)
        == 10
    )
    assert metric_value(t, "pdserve:proxy_spec_decode_acceptance_rate", pool="prefill") == 0.4
    assert metric_value(t, "pdserve:proxy_spec_decode_acceptance_rate", pool="decode") == 0.6
    assert metric_value(t, "pdserve:proxy_spec_decode_mean_acceptance_length", pool="decode") == 2.8
    # an instance without speculation reads as zeros, not as an error
    pd.decode[1].metrics_text = "pdserve:num_requests_running 0\n"
    d1 = pd.decode[1].url
    assert wait_until(lambda: metric_value(text(), name, pool="decode", instance=d1) == 0, 5)
    assert metric_value(text(), "pdserve:proxy_spec_decode_acceptance_rate", pool="decode") == 0.5


# -- helpers ----------------------------------------------------------------------------


def test_pool_pick_least_loaded_with_round_robin_ties() -> None:
    pool = InstancePool("prefill", ["http://a", "http://b", "http://c"])
    assert pool.pick() is None  # nothing is healthy before the first poll
    for inst in pool.instances:
        pool.set_healthy(inst, True)
    assert [pool.pick().url for _ in range(4)] == [  # type: ignore[union-attr]
        "http://a",
        "http://b",
        "http://c",
        "http://a",
    ]
    a, b, c = pool.instances
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 1
    assert [pool.pick().url for _ in range(3)] == ["http://b", "http://c", "http://b"]  # type: ignore[union-attr]
    assert pool.pick(exclude=["http://b", "http://c"]) is a
    pool.set_healthy(a, False)
    assert pool.pick(exclude=["http://b", "http://c"]) is None
    with pool.lease(b):
        assert b.in_flight == 2
    assert b.in_flight == 1


def test_url_validation() -> None:
    assert normalize_url("127.0.0.1:8100", what="x") == "http://127.0.0.1:8100"
    assert normalize_url(" https://h:1/base/ ", what="x") == "https://h:1/base"
    for bad in ("", "ftp://h:1", "http://", "http://h:99999", "http://h:1/?q=1"):
        with pytest.raises(ValueError, match="--prefill"):
            normalize_url(bad, what="--prefill")
    with pytest.raises(ValueError, match="twice"):
        normalize_urls(["h:1", "http://h:1/"], what="--decode")
    with pytest.raises(ValueError, match="at least one"):
        build_proxy_app([], ["h:1"])
    with pytest.raises(ValueError, match="health-interval"):
        build_proxy_app(["h:1"], ["h:2"], health_interval=0)
    with pytest.raises(ValueError, match="request-timeout"):
        build_proxy_app(["h:1"], ["h:2"], request_timeout=-1)


def test_prefill_body_rules() -> None:
    secret = new_secret().encode()
    chat = {"messages": [], "max_completion_tokens": 50, "stream": True, "n": 3, "best_of": 3}
    out = prefill_body(chat, secret, "r")
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert "n" not in out and "best_of" not in out and chat["n"] == 3  # one sample on P
    assert out["stream"] is False and chat["stream"] is True
    assert "max_completion_tokens" not in prefill_body({"prompt": "x"}, secret, "r")
    assert verify_kv_params(out["kv_transfer_params"], secret)["do_remote_decode"] is True
    # the Responses API names its limit max_output_tokens (and has no max_tokens)
    resp = prefill_body({"input": "x", "max_output_tokens": 9}, secret, "r", "/v1/responses")
    assert resp["max_output_tokens"] == 1 and "max_tokens" not in resp


def test_sse_meter() -> None:
    m = SSEMeter()
    ev = b'data: {"choices": [{"text": "a"}]}\r\n\r\n'
    m.feed(ev[:10], 1.0)
    assert m.count == 0 and not m.at_event_boundary
    m.feed(ev[10:] + b'data: {"choices": [{"text": "b"}]}\n\n', 2.0)
    m.feed(b": comment\n\n" + b'data: {"choices": [], "usage": {}}\n\n', 3.0)
    m.feed(b'data: {"choices": [{"text": "c"}]}\n\ndata: not json\n\n', 5.0)
    assert not m.done
    m.feed(b"data: [DONE]\n\n", 6.0)
    assert (m.count, m.first, m.last, m.done, m.at_event_boundary) == (3, 2.0, 5.0, True, True)
    assert m.tpot() == pytest.approx(1.5)
    assert SSEMeter().tpot() is None


# -- command line -----------------------------------------------------------------------


def test_cli_bad_url_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    proxy_mod.add_cli_args(parser)
    args = parser.parse_args(["--prefill", "ftp://x:1", "--decode", "h:2"])
    assert args.func is proxy_mod.main
    assert args.host == "127.0.0.1" and args.port == 8000 and args.health_interval == 2.0
    assert args.request_timeout == 600.0 and args.api_key is None
    assert proxy_mod.main(args) == 2
    assert "--prefill" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill", "h:1", "--decode", "h:2", "--health-interval", "0"])


_SCRIPT = """
import argparse, sys
from pdserve.serving.proxy import cli as proxy
p = argparse.ArgumentParser()
proxy.add_cli_args(p)
a = p.parse_args(sys.argv[1:])
sys.exit(a.func(a))
"""


@contextlib.contextmanager
def cli_proxy(args: list[str], log: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``pdserve proxy ARGS --port 0`` in a child process; yields it and its base URL
    once ``/health`` answers 200. Killed on exit if still running."""
    cmd = [sys.executable, "-c", _SCRIPT, *args, "--port", "0"]
    with (
        log.open("w") as err,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True) as proc,
    ):
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            match = re.search(r"http://127\.0\.0\.1:\d+", line)
            assert match, (line, log.read_text())
            url = match.group(0)
            assert wait_until(lambda: _get_ok(url + "/health"), timeout=10)
            yield proc, url
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_main_serves_until_sigterm_and_exits_0(make_pd: PDFactory, tmp_path: Path) -> None:
    fakes = make_pd()
    args = ["--prefill", fakes.prefill[0].url, "--decode", fakes.decode[0].url]
    with cli_proxy([*args, "--health-interval", "0.5"], tmp_path / "log") as (proc, url):
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, (tmp_path / "log").read_text()


def test_sigterm_drains_streams_then_cancels_past_the_timeout(
    make_pd: PDFactory, tmp_path: Path
) -> None:
    fakes = make_pd(
        2,
        2,
        decode_knobs=[
            {"num_chunks": 30, "chunk_delay": 0.02},
            {"num_chunks": 10_000, "chunk_delay": 0.01},
        ],
    )
    args = ["--prefill", *(f.url for f in fakes.prefill), "--decode"]
    args += [*(f.url for f in fakes.decode), "--shutdown-timeout", "1"]
    with cli_proxy(args, tmp_path / "log") as (proc, base):
        url = base + "/v1/completions"
        body = dict(BODY, stream=True)
        with (
            httpx.Client(timeout=10) as c1,
            httpx.Client(timeout=10) as c2,
            c1.stream("POST", url, json=body) as short,
            c2.stream("POST", url, json=body) as long_,
        ):
            short_it, long_it = short.iter_raw(), long_.iter_raw()
            next(short_it), next(long_it)  # both streams are running
            proc.send_signal(signal.SIGTERM)
            short_rest = b"".join(short_it)
            long_rest = b""
            with pytest.raises(httpx.RemoteProtocolError):  # cut at the drain timeout
                for piece in long_it:
                    long_rest += piece
        assert short_rest.endswith(b"data: [DONE]\n\n")  # drained to the end
        assert b"data: [DONE]" not in long_rest
        assert proc.wait(timeout=15) == 0, (tmp_path / "log").read_text()
    assert wait_until(lambda: fakes.decode[1].disconnects == 1)
    assert fakes.decode[1].completed == 0
    # the cancelled request's KV was released on its prefill instance
    assert wait_until(lambda: sum(len(f.releases) for f in fakes.prefill) == 1)
