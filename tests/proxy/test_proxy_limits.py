"""Client-side limits of a real ``pdserve proxy`` process (fake instances, loopback): a
200 MB body is answered 413 before it is read and the proxy's RSS hardly moves, JSON
nested too deep to parse is a 400, a request whose headers (or body) do not arrive
within the configured timeout gets 408 and its connection is closed, and a client that
disconnects mid-upload leaves no traceback in the proxy's log."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from .procs import running, start_fake, start_proxy

MB = 1_000_000


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _status_line(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


def _closed_within(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    sock.settimeout(limit)
    t0 = time.monotonic()
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return time.monotonic() - t0, got


@pytest.mark.timeout(120)
def test_proxy_body_limit_json_errors_timeouts_and_quiet_disconnects(tmp_path: Path) -> None:
    pre = start_fake("prefill", tmp_path / "prefill.log")
    dec = start_fake("decode", tmp_path / "decode.log")
    log = tmp_path / "proxy.log"
    proxy = start_proxy(
        [pre.url],
        [dec.url],
        log,
        "--header-timeout",
        "1",
        "--body-timeout",
        "1.5",
        "--max-request-body-bytes",
        str(4 * MB),
    )
    host, port = "127.0.0.1", int(proxy.url.rsplit(":", 1)[1])
    with running(proxy, pre, dec):
        pid = proxy.proc.pid
        # -- 413 before the body is read; the rest is discarded as it arrives -------------
        rss_before = _rss_kib(pid)
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {200 * MB}\r\n\r\n"
        ).encode()
        with socket.create_connection((host, port)) as s:
            s.sendall(head)
            assert b" 413 " in _status_line(s), "no 413 before the body"
            chunk = b"x" * MB
            try:
                for _ in range(200):  # a naive client uploads it all anyway
                    s.sendall(chunk)
            except OSError:
                pass  # (or the proxy may close the connection meanwhile)
        growth_mib = (_rss_kib(pid, "VmHWM") - rss_before) / 1024
        assert growth_mib < 20, f"proxy RSS grew {growth_mib:.1f} MiB for a refused body"
        r = httpx.post(f"{proxy.url}/v1/completions", content=b"{" + b" " * (5 * MB), timeout=10)
        assert r.status_code == 413 and "--max-request-body-bytes" in r.text
        # -- every JSON error is a 400 ----------------------------------------------------
        for body in (b"[" * 100_000, b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
            r = httpx.post(f"{proxy.url}/v1/completions", content=body, timeout=10)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == 400
        # -- slowloris: headers, then a body, that never finish ---------------------------
        with socket.create_connection((host, port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            took, got = _closed_within(s, 10)
        assert took < 3 and got.startswith(b"HTTP/1.1 408"), (took, got)
        with socket.create_connection((host, port)) as s:
            s.sendall(head.replace(str(200 * MB).encode(), b"100") + b"{")
            took, got = _closed_within(s, 10)
        assert took < 4 and got.startswith(b"HTTP/1.1 408"), (took, got)
        # -- a client gone mid-upload ---------------------------------------------------------
        for _ in range(3):
            with socket.create_connection((host, port)) as s:
                s.sendall(head.replace(str(200 * MB).encode(), str(MB).encode()) + b"{" * 1000)
        time.sleep(0.5)
        ok = httpx.post(
            f"{proxy.url}/v1/completions",
            json={"model": "fake", "prompt": "p", "max_tokens": 2},
            timeout=10,
        )
        assert ok.status_code == 200, ok.text
        assert "choices" in json.loads(ok.content)
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI" not in text, text[-3000:]
