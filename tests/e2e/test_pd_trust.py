"""The report's attacks on a real 1P1D topology (launcher, tiny engines, proxy; CPU,
loopback), as someone who can read the proxy-to-instance hop: kv_transfer_params
captured there and replayed are refused and never turned into tokens, and both servers
close a slowloris connection within the configured header timeout.

* decode-leg params captured and sent with *another prompt of the same length*: 403,
  no tokens (the report got the original prompt's continuation back), and the params
  are not spent by it (their own request still completes, with the same answer the
  proxy gives); sent again with their own prompt: 403 (single use);
* prefill-leg params replayed for other prompts: 403, no KV held for them (the report
  held 72 leases, 27.5 % of the pool, with one captured leg);
* a request whose headers never finish: 408 and closed by the decode instance and by
  the proxy within ``--header-timeout 1`` (default 15 s); JSON nested 100,000 deep
  sent to the proxy: 400.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx

from _polling import wait_until
from pdserve.core_types.pd_auth import load_secret, sign_kv_params
from pdserve.serving.launch.launcher import Launcher
from pdserve.serving.launch.topology import Topology

from .conftest import metric
from .test_pd_topology import _topology

PROMPT = [11 + (7 * i) % 300 for i in range(40)]
OTHER = [t + 1 for t in PROMPT]  # as long: the same number of KV blocks


def _body(prompt: list[int], kv: dict | None = None, max_tokens: int = 8) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


def _slowloris_closed(port: int) -> tuple[float, bytes]:
    """Seconds until the server closed a connection whose headers never finished."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        s.settimeout(10)
        t0 = time.monotonic()
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return time.monotonic() - t0, got


def test_captured_params_are_refused_and_slowloris_is_cut(tiny_llama: Path, tmp_path: Path) -> None:
    topo, ports = _topology(tiny_llama, prefill=1, colocated=False)
    topo["common_args"] = [*topo["common_args"], "--header-timeout", "1"]
    topo["proxy"]["args"] = ["--header-timeout", "1"]
    secret = load_secret()
    assert secret is not None  # tests/conftest.py sets the session's
    url = {r: f"http://127.0.0.1:{ports[r]}" for r in ("proxy", "prefill", "decode")}
    with (
        open(os.devnull, "w") as quiet,
        Launcher(Topology.from_dict(topo), log_dir=tmp_path / "logs", out=quiet),
        httpx.Client(timeout=60) as c,
    ):
        reference = c.post(f"{url['proxy']}/v1/completions", json=_body(PROMPT))
        assert reference.status_code == 200, reference.text
        answer = reference.json()["choices"][0]["text"]

        # -- what the proxy sends on each leg, as captured on the wire --------------------
        rid = "captured-1"
        prefill_kv = sign_kv_params({"do_remote_decode": True}, secret, request_id=rid)
        pre = c.post(
            f"{url['prefill']}/v1/completions",
            json=_body(PROMPT, prefill_kv, max_tokens=1),
            headers={"X-Request-Id": rid},
        )
        assert pre.status_code == 200, pre.text
        decode_kv = sign_kv_params(pre.json()["kv_transfer_params"], secret, request_id=rid)

        def decode(prompt: list[int]) -> httpx.Response:
            return c.post(
                f"{url['decode']}/v1/completions",
                json=_body(prompt, decode_kv),
                headers={"X-Request-Id": rid},
            )

        stolen = decode(OTHER)
        assert stolen.status_code == 403, stolen.text
        assert "another prompt" in stolen.text and "choices" not in stolen.json()
        own = decode(PROMPT)  # the request they were issued for is not hurt
        assert own.status_code == 200, own.text
        assert own.json()["choices"][0]["text"] == answer
        for prompt in (PROMPT, OTHER):
            replayed = decode(prompt)
            assert replayed.status_code == 403, replayed.text
            assert "choices" not in replayed.json()

        # -- prefill-leg params replayed for other prompts --------------------------------
        for i in range(3):
            other = [5 + (i + j) % 200 for j in range(200)]
            r = c.post(
                f"{url['prefill']}/v1/completions",
                json=_body(other, prefill_kv, max_tokens=1),
                headers={"X-Request-Id": rid},
            )
            assert r.status_code == 403 and "already used" in r.text, r.text
        assert wait_until(
            lambda: metric(url["prefill"], "pdserve:num_requests_kv_held_for_decode") == 0, 10
        )
        # the decode's one read (of its own prompt) and the proxy's request: no other pull
        assert metric(url["decode"], "pdserve:kv_transfer_time_seconds_count") == 2
        assert metric(url["decode"], "pdserve:kv_transfer_failures_total", missing_ok=True) == 0

        # -- slowloris and nesting --------------------------------------------------------
        for role in ("decode", "proxy"):
            took, got = _slowloris_closed(ports[role])
            assert took < 3.0 and got.startswith(b"HTTP/1.1 408"), (role, took, got)
        nested = c.post(f"{url['proxy']}/v1/completions", content=b"[" * 100_000)
        assert nested.status_code == 400, nested.text
