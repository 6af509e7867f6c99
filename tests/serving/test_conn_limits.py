"""Connection limits of the shared uvicorn runner (``pdserve.serving.conn_limits``): a
slowloris request (headers or body too slow) gets 408 and its connection is closed
within the configured time, a connection that never sends a byte is closed after the
keep-alive timeout, idle connections past the cap are closed, and an ordinary client
on a kept-alive connection is not disturbed. A tiny app under
:class:`~pdserve.serving.uvicorn_server.UvicornServer` in a thread, on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, Request

from _polling import wait_until
from pdserve.serving import conn_limits
from pdserve.serving.conn_limits import ConnectionLimits
from pdserve.serving.uvicorn_server import UvicornServer


class _Served:
    def __init__(self, limits: ConnectionLimits, keep_alive: float) -> None:
        app = FastAPI()

        @app.post("/echo")
        async def echo(request: Request) -> dict[str, int]:
            return {"n": len(await request.body())}

        self.server = UvicornServer(
            app,
            port=0,
            log_level="warning",
            install_signal_handlers=False,
            limits=limits,
            timeout_keep_alive=keep_alive,
        )
        self.server.bind()
        self.port = self.server.port
        self.thread = threading.Thread(target=asyncio.run, args=(self.server.serve(),))
        self.thread.start()
        assert self.server.started.wait(10)

    def stop(self) -> None:
        self.server.request_shutdown()
        self.thread.join(10)


@pytest.fixture
def served() -> Iterator[_Served]:
    srv = _Served(ConnectionLimits(0.5, 0.8, max_idle_connections=3), keep_alive=1.5)
    yield srv
    srv.stop()


def _closed_after(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the peer closed ``sock`` (reading what it sent), at most ``limit``."""
    sock.settimeout(0.05)
    t0 = time.monotonic()
    got = b""
    while time.monotonic() - t0 < limit:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0, got
        if not chunk:
            return time.monotonic() - t0, got
        got += chunk
    raise AssertionError(f"still open after {limit}s (got {got!r})")


def test_slow_headers_get_408_and_are_closed(served: _Served) -> None:
    with socket.create_connection(("127.0.0.1", served.port)) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        took, got = _closed_after(s, 5)
    assert 0.4 < took < 2.0, took
    assert got.startswith(b"HTTP/1.1 408 ") and b"headers" in got


def test_a_slow_body_is_cut_off(served: _Served) -> None:
    with socket.create_connection(("127.0.0.1", served.port)) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.5:  # one byte every 0.1 s: it would take 10 s
            s.sendall(b"x")
            time.sleep(0.1)
        took, got = _closed_after(s, 5)
    assert took + 0.5 < 2.5, took
    assert got.startswith(b"HTTP/1.1 408 ") and b"body" in got


def test_silent_and_surplus_idle_connections_are_closed(served: _Served) -> None:
    socks = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(5)]
    try:
        # the cap is 3: the two connections idle longest are closed at once
        assert wait_until(lambda: _is_closed(socks[0], 0.01) and _is_closed(socks[1], 0.01), 1)
        assert not any(_is_closed(s, 0.01) for s in socks[2:])
        # the rest never send a byte: closed after the keep-alive timeout (1.5 s)
        took, _ = _closed_after(socks[4], 5)
        assert took < 3.0
    finally:
        for s in socks:
            s.close()


def _is_closed(sock: socket.socket, wait: float) -> bool:
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_ordinary_clients_are_not_disturbed(served: _Served) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{served.port}", timeout=5) as c:
        for n in (0, 10, 100_000):
            assert c.post("/echo", content=b"y" * n).json() == {"n": n}
            time.sleep(0.6)  # longer than the header timeout, between requests


def test_limits_are_validated_and_come_from_flags() -> None:
    for bad in ({"header_timeout": 0}, {"body_timeout": float("nan")}, {"max_idle_connections": 0}):
        with pytest.raises(ValueError, match="must be"):
            ConnectionLimits(**bad)  # type: ignore[arg-type]
    p = argparse.ArgumentParser()
    conn_limits.add_cli_args(p)
    args = p.parse_args(["--header-timeout", "2", "--max-idle-connections", "7"])
    assert conn_limits.from_args(args) == ConnectionLimits(2.0, 60.0, 7)
    assert conn_limits.from_args(p.parse_args([])).header_timeout <= 30
    for argv in (
        ["--header-timeout", "0"],
        ["--body-timeout", "x"],
        ["--max-idle-connections", "0"],
    ):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
