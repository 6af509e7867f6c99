"""Fixtures for the bench tests: a tiny tokenizer and a fake OpenAI streaming server.

The fake server runs aiohttp.web on 127.0.0.1 (port 0) in a background thread
with its own event loop, so both ``asyncio.run`` based code (``main``) and
direct coroutine tests can talk to it. Every request is answered with a bounded,
deterministic stream; behaviour per request is chosen by the integer suffix of
its ``x-request-id`` header.

``GET /metrics`` answers like a pdserve instance: prefix-cache counters (each prompt
word is one query token, ``prefix_hit_ratio`` of them hits), ``num_requests_running``
(streams open now), ``kv_cache_usage_perc`` and the API process's RSS, which grows by
``rss_bytes_per_request`` per finished request, plus a warm-up that flattens:
``rss_warmup_bytes`` · (1 - exp(-finished / ``rss_warmup_requests``)). ``latency_of(in_flight)`` (optional)
picks ``(ttft_s, itl_s)`` before each token from the number of streams open then (a
stream leaves the count before its last token is sent), a load-dependent server for the
SLA search; ``serial_s`` makes first tokens wait for one slot (a server that completes at
most ``1 / serial_s`` requests a second, whatever the latencies say).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers, processors

WORDS = [f"a{i}" for i in range(60)]


def build_tiny_tokenizer(folder: Path, add_bos: bool = True, post_processor: bool = True) -> Path:
    """WordLevel tokenizer: [UNK]=0 [BOS]=1 [EOS]=2, words a0..a59, added special <|end|>.

    With ``post_processor`` the tokenizer.json adds [BOS]; without it only the
    config's ``add_bos_token`` can.
    """
    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2}
    for w in WORDS:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[UNK]", "[BOS]", "[EOS]", "<|end|>"])
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="[BOS] $A", pair="[BOS] $A [BOS] $B", special_tokens=[("[BOS]", 1)]
        )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def tiny_tokenizer_dir(tmp_path: Path) -> Path:
    return build_tiny_tokenizer(tmp_path / "tiny-tok")


@pytest.fixture
def make_tiny_tokenizer(tmp_path: Path) -> Callable[..., Path]:
    """``make(name, add_bos=..., post_processor=...) -> folder``: tiny tokenizer variants."""

    def make(name: str, add_bos: bool = True, post_processor: bool = True) -> Path:
        return build_tiny_tokenizer(tmp_path / name, add_bos, post_processor)

    return make


@dataclass
class FakeBehavior:
    """How the fake server answers. ``mode_of(i)`` is one of ok / http500 / no_choices."""

    ttft_s: float = 0.05
    itl_s: float = 0.01
    num_tokens: int | None = None  # None: the request's max tokens
    include_usage: bool = True
    prompt_token_bonus: int = 1  # usage.prompt_tokens = words in prompt + bonus
    mode_of: Callable[[int], str] = lambda i: "ok"
    health_failures: int = 0  # /health and /v1/models answer 503 this many times first
    prefix_hit_ratio: float = 0.0
    metrics: bool = True  # False: /metrics is 404 (an OpenAI server without it)
    rss_bytes_per_request: int = 0
    rss_warmup_bytes: int = 0
    rss_warmup_requests: float = 30.0
    latency_of: Callable[[int], tuple[float, float]] | None = None
    serial_s: float = 0.0  # > 0: first tokens one at a time, this long each (1/serial_s req/s)


@dataclass
class FakeServer:
    url: str
    behavior: FakeBehavior
    payloads: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    health_calls: int = 0  # /health and /v1/models calls
    in_flight: int = 0
    finished: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


def _index(request: web.Request) -> int:
    rid = request.headers.get("x-request-id", "")
    digits = rid.rsplit("-", 1)[-1]
    return int(digits) if digits.isdigit() else 0


def _make_app(state: FakeServer) -> web.Application:
    b = state.behavior
    serial = asyncio.Lock()  # the one "prefill slot" of a serial_s server

    async def health(request: web.Request) -> web.Response:
        state.health_calls += 1
        if state.health_calls <= b.health_failures:
            return web.Response(status=503)
        return web.Response(text="ok")

    async def list_models(request: web.Request) -> web.Response:
        state.health_calls += 1
        if state.health_calls <= b.health_failures:
            return web.Response(status=503)
        return web.json_response(
            {"object": "list", "data": [{"id": "fake-model", "root": "fake-org/fake-model"}]}
        )

    async def stream(request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        state.payloads.append(body)
        state.headers.append({k.lower(): v for k, v in request.headers.items()})
        mode = b.mode_of(_index(request))
        if mode == "http500":
            return web.Response(status=500, text="boom")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        max_tokens = body["max_completion_tokens"] if chat else body["max_tokens"]
        n = b.num_tokens if b.num_tokens is not None else int(max_tokens)
        words = len(prompt.split())
        state.prefix_queries += words
        state.prefix_hits += int(words * b.prefix_hit_ratio)
        state.in_flight += 1
        held = [True]  # this request still counts as in flight

        def leave() -> None:
            if held[0]:
                held[0] = False
                state.in_flight -= 1

        try:
            return await _answer(request, chat, mode, prompt, n, leave)
        finally:
            leave()
            state.finished += 1

    async def _answer(
        request: web.Request,
        chat: bool,
        mode: str,
        prompt: str,
        n: int,
        leave: Callable[[], None],
    ) -> web.StreamResponse:
        def delay(k: int) -> float:
            if b.latency_of is None:
                return b.ttft_s if k == 0 else b.itl_s
            ttft_s, itl_s = b.latency_of(state.in_flight)
            return ttft_s if k == 0 else itl_s

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        await resp.write(b": keep-alive ping\n\n")
        if mode == "ok":
            for k in range(n):
                await asyncio.sleep(delay(k))
                if k == 0 and b.serial_s > 0:
                    async with serial:
                        await asyncio.sleep(b.serial_s)
                if k == n - 1:  # leave the count before the client can see the end
                    leave()
                if chat:
                    if k == 0:
                        await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                    choice = {"index": 0, "delta": {"content": f" a{k % 60}"}}
                else:
                    choice = {"index": 0, "text": f" a{k % 60}"}
                choice["finish_reason"] = "length" if k == n - 1 else None
                raw = f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n".encode()
                if k == 1:  # one event split across two writes
                    await resp.write(raw[:7])
                    await resp.write(raw[7:])
                else:
                    await resp.write(raw)
        if b.include_usage:
            usage = {
                "prompt_tokens": len(prompt.split()) + b.prompt_token_bonus,
                "completion_tokens": n if mode == "ok" else 0,
                "total_tokens": 0,
            }
            await send({"id": "x", "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(request: web.Request) -> web.Response:
        if not b.metrics:
            return web.Response(status=404)
        lab = 'engine="0",model_name="fake-model"'
        lines = [
            f"pdserve:prefix_cache_queries_total{{{lab}}} {float(state.prefix_queries)}",
            f"pdserve:prefix_cache_hits_total{{{lab}}} {float(state.prefix_hits)}",
            f"pdserve:num_requests_running{{{lab}}} {float(state.in_flight)}",
            f"pdserve:num_requests_waiting{{{lab}}} 0.0",
            f"pdserve:kv_cache_usage_perc{{{lab}}} {min(1.0, state.in_flight / 100)}",
            f'pdserve:process_rss_bytes{{{lab},process="api_server"}} '
            f"{100e6 + b.rss_bytes_per_request * state.finished + _warmup(b, state.finished)}",
            f'pdserve:process_rss_bytes{{{lab},process="engine_core"}} 200000000.0',
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await stream(request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await stream(request, chat=True)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


def _warmup(b: FakeBehavior, finished: int) -> float:
    return b.rss_warmup_bytes * (1.0 - math.exp(-finished / b.rss_warmup_requests))


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    """Factory: ``start(**FakeBehavior fields) -> FakeServer``; all stop at teardown."""
    stops: list[Callable[[], None]] = []

    def start(**behavior: Any) -> FakeServer:
        state = FakeServer(url="", behavior=FakeBehavior(**behavior))
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        runner_box: list[web.AppRunner] = []

        async def boot() -> None:
            runner = web.AppRunner(_make_app(state))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            state.url = f"http://{host}:{port}"
            runner_box.append(runner)
            ready.set()

        def serve() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(boot())
            loop.run_forever()
            loop.run_until_complete(runner_box[0].cleanup())
            loop.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")

        def stop() -> None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)

        stops.append(stop)
        return state

    yield start
    for stop in stops:
        stop()
