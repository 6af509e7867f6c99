"""Hostile input must neither stall nor crash the API server: the request-body limit
(413 before the body is read), invalid Unicode (400, the connection stays usable),
texts refused by their length before they are tokenized, and the API key on
``/tokenize`` and ``/detokenize``. The server runs in its own process where its RSS is
measured (``_proc_server``); everything is loopback."""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ._proc_server import ProcServer
from .conftest import FakeEngineClient, ServerFactory

MIB = 2**20
TEN_MB = 10_000_000


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the response"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed in the response body"
        body += chunk
    assert len(body) == length  # no pipelined bytes in these tests
    return int(lines[0].split()[1]), body


def _post_head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


SMALL = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
JSON = {"content-type": "application/json"}


def test_body_over_the_limit_is_413_before_it_is_read() -> None:
    """The 413 comes while the client has sent only the headers; the rest of the body is
    discarded as it arrives and the next request on the connection is served."""
    with (
        ProcServer("--max-request-body-bytes", str(MIB)) as srv,
        socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock,
    ):
        start = time.perf_counter()
        sock.sendall(_post_head("/v1/completions", TEN_MB))
        status, body = _read_response(sock)
        elapsed = time.perf_counter() - start
        assert status == 413
        err = json.loads(body)["error"]
        assert err["code"] == 413 and "limit of 1048576 bytes" in err["message"]
        assert "--max-request-body-bytes" in err["message"]
        assert elapsed < 0.1, f"413 took {elapsed * 1000:.0f} ms"
        sock.sendall(b"a" * TEN_MB)  # the client goes on to send what it announced
        sock.sendall(_post_head("/v1/completions", len(SMALL)) + SMALL)
        status, body = _read_response(sock)
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"] == "ab"


def test_10mb_bodies_get_413_fast_without_rss_growth() -> None:
    """An ordinary client (uploads everything, then reads): 413 each time, and the server's
    peak RSS does not move (the bodies are never held)."""
    body = b'{"prompt": "' + b"a" * TEN_MB + b'"}'
    with (
        ProcServer("--max-request-body-bytes", str(MIB)) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        assert c.post("/v1/completions", content=SMALL, headers=JSON).status_code == 200
        if not srv.reset_peak_rss():
            pytest.skip("cannot reset the peak RSS of the server process")
        before = srv.rss_kib()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            r = c.post("/v1/completions", content=body, headers=JSON)
            times.append(time.perf_counter() - start)
            assert r.status_code == 413, r.text
        assert c.post("/v1/completions", content=SMALL, headers=JSON).status_code == 200
        growth = srv.peak_rss_kib() - before
    # the upload itself (10 MB through the loopback) is in these times
    assert min(times) < 0.25, times
    assert growth < 8 * 1024, f"peak RSS grew by {growth} KiB"


def test_chunked_body_is_limited_while_it_is_read() -> None:
    with (
        ProcServer("--max-request-body-bytes", str(MIB)) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):

        def big() -> Any:
            for _ in range(200):  # 13 MB, no Content-Length
                yield b"a" * 65536

        def small() -> Any:
            yield b'{"prompt": "hel'
            yield b'lo", "max_tokens": 3}'

        r = c.post("/v1/completions", content=big(), headers=JSON)
        assert r.status_code == 413 and "limit of 1048576" in r.json()["error"]["message"]
        r = c.post("/v1/completions", content=small(), headers=JSON)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 6


def test_default_limit_admits_a_large_token_id_prompt(make_server: ServerFactory) -> None:
    """The default (32 MiB) takes a prompt of a few hundred thousand token ids."""
    engine = FakeEngineClient(max_model_len=400_000, token_delay=0.0)
    srv = make_server(engine)
    ids = [255] * 300_000  # ≥ 4 bytes each as JSON
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 1})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["prompt_tokens"] == 300_000


SURROGATE_BODIES: list[tuple[str, str, str]] = [
    ("/v1/completions", '{"prompt": "ok \\ud800 there", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": ["a", "\\udfff"]}', "stop.1"),
    ("/v1/completions", '{"prompt": "x", "model": "\\ud83d"}', "model"),
    ("/v1/completions", '{"prompt": "x", "metadata": {"k": "\\udc00"}}', "metadata.k"),
    ("/v1/completions", '{"prompt": ["\\ud800"]}', "prompt.0"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi"}, '
        '{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        "messages.1.content.0.text",
    ),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/detokenize", '{"tokens": [1], "model": "\\ud800"}', "model"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_BODIES)
def test_lone_surrogate_is_400_and_the_connection_survives(
    tiny_llama: Path, make_server: ServerFactory, path: str, body: str, param: str
) -> None:
    from pdserve.frontend.tokenizer import Tokenizer

    engine = FakeEngineClient(Tokenizer.from_pretrained(tiny_llama), max_model_len=256)
    srv = make_server(engine)
    conn = http.client.HTTPConnection("127.0.0.1", srv.server.port, timeout=10)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", path, body=body.encode(), headers=headers)
        local = conn.sock.getsockname()
        r = conn.getresponse()
        data = json.loads(r.read())
        assert r.status == 400, data
        assert data["error"]["param"] == param
        assert "lone surrogate" in data["error"]["message"]
        assert r.getheader("connection") != "close"
        conn.request("POST", "/v1/completions", body=SMALL, headers=headers)
        assert conn.sock.getsockname() == local  # the same keep-alive connection
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["choices"][0]["text"] == "ab"
    finally:
        conn.close()
    assert len(engine.requests) == 1  # only the good request reached the engine


def test_a_valid_surrogate_pair_is_fine(
    make_server: ServerFactory, engine: FakeEngineClient
) -> None:
    srv = make_server(engine)
    body = '{"prompt": "smile \\ud83d\\ude42", "max_tokens": 1}'
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        r = c.post("/v1/completions", content=body, headers=JSON)
    assert r.status_code == 200, r.text


class _CountingTokenizer:
    """The real tokenizer, counting ``encode`` calls."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.encoded = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded += 1
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def test_huge_text_is_refused_by_its_length_without_tokenizing(
    tiny_llama: Path, make_server: ServerFactory
) -> None:
    from pdserve.frontend.tokenizer import Tokenizer

    tok = _CountingTokenizer(Tokenizer.from_pretrained(tiny_llama))
    engine = FakeEngineClient(tok, max_model_len=256)
    srv = make_server(engine)
    per = tok.max_chars_per_token
    assert isinstance(per, int)
    text = "hello " * (256 * per // 6 + 10)  # at least 256 tokens by its length
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        for path, body, param in [
            ("/v1/completions", {"prompt": text}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
            ("/tokenize", {"prompt": text}, "prompt"),
        ]:
            r = c.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and "which is at least" in err["message"], err
        assert tok.encoded == 0
        # a text under the bound is tokenized and then checked exactly
        r = c.post("/v1/completions", json={"prompt": "hello " * 200})
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
        assert tok.encoded == 1


def test_10mb_prompt_is_refused_fast_and_small(tiny_llama: Path) -> None:
    """Under the default body limit: refused by its length in well under a second, where
    tokenizing it took 16 s and left the process 1.1 GB larger."""
    body = json.dumps({"prompt": "hello world " * (TEN_MB // 12), "max_tokens": 1}).encode()
    with (
        ProcServer("--tokenizer", str(tiny_llama), "--max-model-len", "2048") as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        assert c.post("/v1/completions", content=SMALL, headers=JSON).status_code == 200
        srv.reset_peak_rss()
        before = srv.rss_kib()
        start = time.perf_counter()
        r = c.post("/v1/completions", content=body, headers=JSON)
        elapsed = time.perf_counter() - start
        assert r.status_code == 400 and "which is at least" in r.json()["error"]["message"]
        growth = srv.peak_rss_kib() - before
    assert elapsed < 2.0, elapsed
    assert growth < 100 * 1024, f"peak RSS grew by {growth} KiB"


def test_api_key_covers_tokenize_and_detokenize(
    engine: FakeEngineClient, make_server: ServerFactory
) -> None:
    srv = make_server(engine, api_key="sekrit")
    ok = {"Authorization": "Bearer sekrit"}
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [104]})]:
            r = c.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
            assert (
                c.post(path, json=body, headers={"Authorization": "Bearer no"}).status_code == 401
            )
            assert c.post(path, json=body, headers=ok).status_code == 200
        for path in ("/health", "/metrics", "/version", "/openapi.json"):
            assert c.get(path).status_code == 200, path
        assert c.post("/v1/kv_transfer/release", json={"request_id": "x"}).status_code == 401
