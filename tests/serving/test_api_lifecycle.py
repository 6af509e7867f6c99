"""Client disconnects abort engine requests; SIGTERM drains in-flight work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from _polling import wait_until

from .conftest import FakeEngineClient, ServerFactory, ServerThread


def _stream_lines(srv: ServerThread, body: dict, rid: str, out: list[str]) -> None:
    with (
        httpx.Client(base_url=srv.url, timeout=20) as c,
        c.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r,
    ):
        out.append(f"status {r.status_code}")
        for line in r.iter_lines():
            if line:
                out.append(line)


def test_streaming_disconnect_aborts(make_server: ServerFactory) -> None:
    engine = FakeEngineClient(token_delay=0.01)
    srv = make_server(engine)
    body = {"prompt": "x", "max_tokens": 100, "stream": True}
    with (
        httpx.Client(base_url=srv.url, timeout=10) as c,
        c.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "gone-1"}) as r,
    ):
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen == 3:
                break  # leaving the block closes the connection mid-stream
    assert wait_until(lambda: "gone-1" in engine.aborted, timeout=5)
    assert wait_until(lambda: "gone-1" not in engine.running, timeout=5)
    assert wait_until(lambda: srv.server.ctx.state.in_flight == 0, timeout=5)
    assert srv.server.ctx.state.active_request_ids() == []


def test_non_streaming_disconnect_aborts(make_server: ServerFactory) -> None:
    engine = FakeEngineClient(token_delay=0.01)
    srv = make_server(engine)
    with httpx.Client(base_url=srv.url, timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
        c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 100},
            headers={"X-Request-Id": "gone-2"},
        )
    assert wait_until(lambda: "gone-2" in engine.aborted, timeout=5)
    assert wait_until(lambda: srv.server.ctx.state.in_flight == 0, timeout=5)


@pytest.mark.parametrize("stream", [True, False])
def test_a_batch_of_prompts_is_aborted_whole_on_disconnect(
    make_server: ServerFactory, stream: bool
) -> None:
    """A completions request with a list of prompts: the client leaving aborts every
    prompt's engine request, streamed or not."""
    engine = FakeEngineClient(token_delay=0.01)
    srv = make_server(engine)
    body = {"prompt": ["x", "y", "z"], "max_tokens": 100, "stream": stream}
    rid = f"batch-gone-{stream}"
    ids = {f"{rid}-{i}" for i in range(3)}
    if stream:
        with (
            httpx.Client(base_url=srv.url, timeout=10) as c,
            c.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r,
        ):
            assert r.status_code == 200
            for n, _ in enumerate(ln for ln in r.iter_lines() if ln.startswith("data: ")):
                if n == 5:
                    break
    else:
        with httpx.Client(base_url=srv.url, timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert wait_until(lambda: ids <= set(engine.aborted), timeout=5), engine.aborted
    assert wait_until(lambda: srv.server.ctx.state.in_flight == 0, timeout=5)
    assert srv.server.ctx.state.active_request_ids() == []


def test_finished_requests_are_not_aborted(
    server: ServerThread, server_engine: FakeEngineClient
) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for stream in (False, True):
            body = {"prompt": "x", "max_tokens": 3, "stream": stream}
            assert c.post("/v1/completions", json=body).status_code == 200
    assert server_engine.aborted == []


def test_drain_lets_in_flight_finish_and_refuses_new(make_server: ServerFactory) -> None:
    engine = FakeEngineClient(token_delay=0.02)
    srv = make_server(engine, shutdown_timeout=10.0)
    lines: list[str] = []
    body = {"prompt": "x", "max_tokens": 25, "stream": True}
    t = threading.Thread(target=_stream_lines, args=(srv, body, "inflight-1", lines))
    t.start()
    assert wait_until(lambda: len(lines) >= 3)
    srv.server.request_shutdown()  # what SIGTERM triggers
    assert wait_until(lambda: srv.server.ctx.state.draining)
    with httpx.Client(base_url=srv.url, timeout=5) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == 503
        assert c.get("/health").status_code == 503
        metrics = c.get("/metrics")
        assert metrics.status_code == 200 and "pdserve:" in metrics.text
    t.join(10)
    assert lines[0] == "status 200"
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[1:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == "abcdefghijklmnopqrstuvwxy"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    srv.thread.join(10)
    assert not srv.thread.is_alive()
    assert engine.aborted == []


def test_drain_timeout_aborts_the_rest(make_server: ServerFactory) -> None:
    engine = FakeEngineClient(token_delay=0.02)
    srv = make_server(engine, shutdown_timeout=0.3)
    lines: list[str] = []
    body = {"prompt": "x", "max_tokens": 120, "stream": True}
    t = threading.Thread(target=_stream_lines, args=(srv, body, "slow-1", lines))
    t.start()
    assert wait_until(lambda: len(lines) >= 2)
    srv.server.request_shutdown()
    t.join(10)
    srv.thread.join(10)
    assert not srv.thread.is_alive()
    assert "slow-1" in engine.aborted
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"


_SERVER_SCRIPT = """
import asyncio, sys
sys.path[:0] = [{src!r}, {tests!r}]
from serving.conftest import FakeEngineClient
from pdserve.serving.api.app import build_app
from pdserve.serving.api.server import ApiServer

app = build_app(FakeEngineClient(token_delay=0.02), served_model_names=["m"])
server = ApiServer(app, host="127.0.0.1", port=0, shutdown_timeout=10, log_level="warning")
server.bind()
print(server.port, flush=True)
asyncio.run(server.serve())
print("clean exit", flush=True)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_drains_and_exits_zero(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "serve.py"
    script.write_text(_SERVER_SCRIPT.format(src=str(root / "src"), tests=str(root / "tests")))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _up(url), timeout=10)
        lines: list[str] = []
        srv = type("S", (), {"url": url})()
        body = {"prompt": "x", "max_tokens": 20, "stream": True}
        t = threading.Thread(target=_stream_lines, args=(srv, body, "sig-1", lines))
        t.start()
        assert wait_until(lambda: len(lines) >= 2)
        os.kill(proc.pid, signal.SIGTERM)
        t.join(10)
        assert lines[-1] == "data: [DONE]"
        assert len(lines) == 1 + 20 + 1  # status, 20 token chunks, [DONE]
        out, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err
        assert "clean exit" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
