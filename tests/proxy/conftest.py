"""Fixtures for the P/D proxy tests: fake OpenAI upstreams and the proxy, all on loopback.

One background thread runs an asyncio loop (per test) that hosts every fake upstream
(``aiohttp.web`` on 127.0.0.1, port 0) and the proxy (uvicorn on 127.0.0.1, port 0).
Tests talk to the proxy with ordinary synchronous clients (httpx, openai, raw sockets)
from the main thread. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from aiohttp import web

from pdserve.core_types.pd_auth import NonceCache, SignatureError, load_secret, verify_kv_params
from pdserve.serving.proxy.app import build_proxy_app
from pdserve.serving.proxy.core import ProxyCore

MODEL = "fake-model"


class LoopThread:
    """An asyncio loop in a daemon thread; :meth:`call` runs a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@dataclass
class Seen:
    """One completion request a fake received; ``kv`` is its ``kv_transfer_params`` once
    verified (without the signature fields), ``None`` if it had none."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    kv: dict[str, Any] | None = None


@dataclass
class FakeUpstream:
    """A fake OpenAI server acting as a prefill, a decode or a colocated instance.

    Prefill: answers JSON with ``kv_transfer_params`` (``kv_params`` plus the request id),
    or without them when ``missing_params``. Both verify ``kv_transfer_params`` as an
    instance does (signed with the session's ``PDSERVE_PD_SECRET``, else 403). Decode:
    streams ``num_chunks`` SSE chunks
    ``chunk_delay`` apart, then ``data: [DONE]`` (or answers JSON when not streaming).
    Knobs: ``fail_status`` answers every completion request with that status and an
    OpenAI error body; ``delay`` sleeps before answering; ``drop`` closes the connection
    without answering; ``break_after`` closes it mid-stream after that many chunks;
    ``close_idle_after`` closes, without answering, a connection whose request (health
    probes included) comes more than that many seconds after its previous answer: what
    a server does when its keep-alive timer fires just as the request arrives (counted
    in ``stale_drops``). Handlers are cancelled when the peer disconnects
    (``handler_cancellation``), which ``disconnects`` counts. ``/v1/responses`` answers
    like a completion in the Responses API's shape (text deltas when streaming).
    """

    role: str
    num_chunks: int = 4
    chunk_delay: float = 0.0
    delay: float = 0.0
    fail_status: int | None = None
    missing_params: bool = False
    drop: bool = False
    break_after: int | None = None
    health_status: int = 200
    release_status: int = 200
    close_idle_after: float | None = None
    metrics_text: str = ""  # served at /metrics
    stale_drops: int = 0
    health_probes: int = 0
    seen: list[Seen] = field(default_factory=list)
    releases: list[dict[str, Any]] = field(default_factory=list)
    release_headers: list[dict[str, str]] = field(default_factory=list)
    disconnects: int = 0
    completed: int = 0
    sent_bytes: list[bytes] = field(default_factory=list)
    url: str = ""
    nonces: NonceCache = field(default_factory=NonceCache)  # as an instance: params once
    _runner: web.AppRunner | None = None
    # transport -> time of its last answer; keyed by the transport object itself (held
    # alive here), not by id(): a new connection's transport can reuse a closed one's id
    _last_answer: dict[object, float] = field(default_factory=dict)

    def kv_params(self, request_id: str) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{self.url}",
            "remote_block_ids": [3, 1, 4, 1, 5],
            "remote_request_id": request_id,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "remote_blocks_expiry_time": 1234.5,
        }

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/responses", self._completion)
        app.router.add_post("/v1/kv_transfer/release", self._release)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        """Stop listening (later connections are refused)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _stale(self, request: web.Request) -> bool:
        """Apply ``close_idle_after``; True if the connection was closed unanswered."""
        key, now = request.transport, asyncio.get_running_loop().time()
        last = self._last_answer.get(key)
        self._last_answer[key] = now
        if self.close_idle_after is None or last is None or now - last <= self.close_idle_after:
            return False
        self.stale_drops += 1
        assert request.transport is not None
        request.transport.close()
        return True

    async def _health(self, request: web.Request) -> web.Response:
        if self._stale(request):
            return web.Response(status=500)
        self.health_probes += 1
        return web.Response(status=self.health_status, text="")

    async def _models(self, _: web.Request) -> web.Response:
        data = [{"id": MODEL, "object": "model", "created": 0, "owned_by": self.role}]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _release(self, request: web.Request) -> web.Response:
        secret = load_secret()
        assert secret is not None, "PDSERVE_PD_SECRET is not set"
        try:  # an instance takes releases signed by the proxy only
            body = verify_kv_params(await request.json(), secret, nonces=self.nonces)
        except SignatureError as e:
            err = {"message": str(e), "type": "PermissionError", "param": None, "code": 403}
            return web.json_response({"error": err}, status=403)
        self.releases.append(body)
        self.release_headers.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response({}, status=self.release_status)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self._stale(request):
            return web.Response(status=500)
        seen = Seen(request.path, body, {k.lower(): v for k, v in request.headers.items()})
        self.seen.append(seen)
        if "kv_transfer_params" in body:
            secret = load_secret()
            assert secret is not None  # tests/conftest.py sets it for the session
            try:
                seen.kv = verify_kv_params(
                    body["kv_transfer_params"],
                    secret,
                    request_id=request.headers.get("X-Request-Id"),
                    nonces=self.nonces,
                )
            except SignatureError as e:
                err = {"message": str(e), "type": "PermissionError", "param": None, "code": 403}
                return web.json_response({"error": err}, status=403)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.drop:
                assert request.transport is not None
                request.transport.close()
                return web.Response(status=500)
            if self.fail_status is not None:
                err = {"message": f"fake {self.role} failure", "type": "X", "param": None}
                return web.json_response(
                    {"error": {**err, "code": self.fail_status}}, status=self.fail_status
                )
            chat = request.path.endswith("/chat/completions")
            if body.get("stream"):
                return await self._stream(request, chat)
            if request.path.endswith("/responses"):
                resp = web.json_response(self._response_object(request))
                self.completed += 1
                return resp
            resp = web.json_response(self._answer(request, body, chat))
            self.completed += 1
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        finally:
            self._last_answer[id(request.transport)] = asyncio.get_running_loop().time()

    def _answer(self, request: web.Request, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        rid = request.headers.get("X-Request-Id", "none")
        text = "x" if self.role == "prefill" else "".join(f"t{i}" for i in range(self.num_chunks))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out: dict[str, Any] = {
            "id": f"cmpl-{rid}",
            "object": "chat.completion" if chat else "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
        if self.role == "prefill":
            out["kv_transfer_params"] = None if self.missing_params else self.kv_params(rid)
        return out

    def _response_object(self, request: web.Request) -> dict[str, Any]:
        text = "".join(f"t{i}" for i in range(self.num_chunks))
        content = [{"type": "output_text", "text": text, "annotations": []}]
        return {
            "id": f"resp_{request.headers.get('X-Request-Id', 'none')}",
            "object": "response",
            "status": "completed",
            "model": MODEL,
            "output": [{"type": "message", "role": "assistant", "content": content}],
        }

    def chunk_bytes(self, i: int, chat: bool, responses: bool = False) -> bytes:
        if responses:
            delta = {"type": "response.output_text.delta", "delta": f"t{i}", "sequence_number": i}
            return (
                b"event: response.output_text.delta\ndata: " + json.dumps(delta).encode() + b"\n\n"
            )
        last = i == self.num_chunks - 1
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
        if chat:
            choice["delta"] = {"content": f"t{i}"}
        else:
            choice.update(text=f"t{i}", logprobs=None)
        obj = {
            "id": "cmpl-1",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [choice],
        }
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    async def _stream(self, request: web.Request, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.num_chunks):
            if i and self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
            if i == self.break_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            data = self.chunk_bytes(i, chat, request.path.endswith("/responses"))
            await resp.write(data)
            self.sent_bytes.append(data)
        await resp.write(b"data: [DONE]\n\n")
        self.sent_bytes.append(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.completed += 1
        return resp


class ProxyServer:
    """The proxy app under uvicorn on 127.0.0.1:<ephemeral>, in the test loop."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, lifespan="on", log_level="warning")
        self.server = uvicorn.Server(config)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        for _ in range(1000):
            if self.server.started or self.task.done():
                break
            await asyncio.sleep(0.01)
        if not self.server.started:
            raise RuntimeError("proxy did not start")

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await asyncio.wait_for(self.task, 15)
        self.sock.close()


@dataclass
class PD:
    """A running topology: fake prefill/decode (or colocated) instances behind the proxy."""

    loop: LoopThread
    prefill: list[FakeUpstream]
    decode: list[FakeUpstream]
    proxy: ProxyServer
    colocated: list[FakeUpstream] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def core(self) -> ProxyCore:
        core: ProxyCore = self.proxy.app.state.proxy
        return core

    def metrics(self) -> str:
        import httpx

        return httpx.get(self.url + "/metrics", timeout=5).text

    def stop_upstream(self, fake: FakeUpstream) -> None:
        self.loop.call(fake.stop())


def stream_raw(url: str, body: dict[str, Any]) -> tuple[bytes, list[float]]:
    """POST a streamed completion through the proxy: the raw bytes received and when
    (seconds after the request) each piece arrived; checks the SSE status and type."""
    import time

    import httpx

    arrivals: list[float] = []
    received = b""
    t0 = time.monotonic()
    with (
        httpx.Client(timeout=10) as c,
        c.stream("POST", url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for piece in r.iter_raw():
            arrivals.append(time.monotonic() - t0)
            received += piece
    return received, arrivals


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The sample ``name{labels}`` in a text exposition (labels must all match)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


PDFactory = Callable[..., PD]
Knobs = dict[str, Any] | list[dict[str, Any]] | None


def _knobs_for(knobs: Knobs, i: int) -> dict[str, Any]:
    if knobs is None:
        return {}
    return knobs[i] if isinstance(knobs, list) else knobs


class _Topologies:
    """Starts fakes and proxies in one loop thread; :meth:`close` stops them all."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.started: list[PD] = []

    def fakes(self, role: str, n: int, knobs: Knobs) -> list[FakeUpstream]:
        fakes = [FakeUpstream(role, **_knobs_for(knobs, i)) for i in range(n)]
        for fake in fakes:
            self.loop.call(fake.start())
        return fakes

    def serve(self, app: Any, **pools: list[FakeUpstream]) -> PD:
        proxy = ProxyServer(app)
        self.loop.call(proxy.start())
        pd = PD(self.loop, pools.get("prefill", []), pools.get("decode", []), proxy)
        pd.colocated = pools.get("colocated", [])
        self.started.append(pd)
        return pd

    def close(self) -> None:
        for pd in self.started:
            self.loop.call(pd.proxy.stop(), timeout=20)
            for fake in pd.prefill + pd.decode + pd.colocated:
                self.loop.call(fake.stop())
        self.loop.close()


@pytest.fixture
def make_pd() -> Iterator[PDFactory]:
    """``make_pd(n_prefill=1, n_decode=1, prefill_knobs=..., decode_knobs=...,
    decode_urls=..., **app_kwargs)``.

    ``*_knobs`` is a dict of :class:`FakeUpstream` fields applied to every fake of the
    pool, or a list with one dict per fake. ``decode_urls`` adds decode instances the
    test runs itself (e.g. ``fake_instance.py`` processes).
    """
    tops = _Topologies()

    def factory(
        n_prefill: int = 1,
        n_decode: int = 1,
        *,
        prefill_knobs: Knobs = None,
        decode_knobs: Knobs = None,
        decode_urls: list[str] | None = None,
        **app_kwargs: Any,
    ) -> PD:
        prefill = tops.fakes("prefill", n_prefill, prefill_knobs)
        decode = tops.fakes("decode", n_decode, decode_knobs)
        app_kwargs.setdefault("health_interval", 30.0)
        urls = [f.url for f in decode] + (decode_urls or [])
        app = build_proxy_app([f.url for f in prefill], urls, **app_kwargs)
        return tops.serve(app, prefill=prefill, decode=decode)

    yield factory
    tops.close()


@pytest.fixture
def make_colocated() -> Iterator[PDFactory]:
    """``make_colocated(n=2, knobs=..., **app_kwargs)``: ``n`` fake colocated instances
    (``pd.colocated``) behind a proxy built with ``colocated_urls``; ``knobs`` as for
    :func:`make_pd`."""
    tops = _Topologies()

    def factory(n: int = 2, *, knobs: Knobs = None, **app_kwargs: Any) -> PD:
        fakes = tops.fakes("colocated", n, knobs)
        app_kwargs.setdefault("health_interval", 30.0)
        app = build_proxy_app(colocated_urls=[f.url for f in fakes], **app_kwargs)
        return tops.serve(app, colocated=fakes)

    yield factory
    tops.close()
