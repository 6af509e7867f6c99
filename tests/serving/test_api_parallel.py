"""``n`` > 1 in the API server over the fake engine: child requests and their seeds, a
client disconnect aborts every child, P/D (a decode leg's siblings start after choice
0's first output and carry no KV params; a prefill leg takes n=1 only; prompt_logprobs
are refused with remote-prefill params)."""

from __future__ import annotations

from typing import Any

import httpx

from _polling import wait_until

from .conftest import FakeEngineClient, ServerFactory, prompt_ids_of, signed

DECODE_KV: dict[str, Any] = {
    "do_remote_prefill": True,
    "remote_block_ids": [1, 2],
    "remote_request_id": "p-1",
    "remote_host": "127.0.0.1",
    "remote_port": 7777,
}


class RecordingEngine(FakeEngineClient):
    """Records, in order, each request's start and each of its outputs."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.log: list[tuple[str, str]] = []

    def generate(self, request_id: str, *args: Any, **kw: Any) -> Any:
        self.log.append(("start", request_id))
        inner = super().generate(request_id, *args, **kw)

        async def run() -> Any:
            async for out in inner:
                self.log.append(("out", request_id))
                yield out

        return run()


def test_children_ids_seeds_and_choices(make_server: ServerFactory) -> None:
    engine = RecordingEngine()
    srv = make_server(engine)
    body = {"prompt": "q", "max_tokens": 2, "n": 3, "seed": 40}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"X-Request-Id": "par"})
    assert r.status_code == 200
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert r.json()["usage"]["completion_tokens"] == 6
    seeds = {rid: p.seed for rid, (_, p, _) in engine.requests.items()}
    assert seeds == {"0_par": 40, "1_par": 41, "2_par": 42}
    assert all(p.n == 1 for _, p, _ in engine.requests.values())


def test_disconnect_aborts_every_child(make_server: ServerFactory) -> None:
    engine = FakeEngineClient(token_delay=0.01)
    srv = make_server(engine)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100, "n": 3}
    with (
        httpx.Client(base_url=srv.url, timeout=10) as c,
        c.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True},
            headers={"X-Request-Id": "bye"},
        ) as r,
    ):  # fmt: skip
        assert r.status_code == 200
        seen = set()
        for line in r.iter_lines():
            if line.startswith('data: {"id"'):
                seen.add(line.split('"index":')[1][0])
            if len(seen) == 3:
                break  # every choice has streamed; leaving closes the connection
    kids = {"0_bye", "1_bye", "2_bye"}
    assert wait_until(lambda: kids <= set(engine.aborted), timeout=5)
    assert wait_until(lambda: not engine.running, timeout=5)
    assert wait_until(lambda: srv.server.ctx.state.active_request_ids() == [], timeout=5)


def test_decode_leg_siblings_wait_for_the_pulled_prompt(make_server: ServerFactory) -> None:
    engine = RecordingEngine()
    srv = make_server(engine)
    for stream in (False, True):
        rid = f"d{int(stream)}"
        body: dict[str, Any] = {"prompt": "q", "max_tokens": 3, "n": 3}
        body["kv_transfer_params"] = signed(DECODE_KV, rid, prompt_ids_of(srv.url, body))
        r = httpx.post(
            f"{srv.url}/v1/completions",
            json={**body, "stream": stream},
            headers={"X-Request-Id": rid},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        kv = {k: v for k, (_, _, v) in engine.requests.items() if k.endswith(rid)}
        assert kv[f"0_{rid}"] is not None and kv[f"0_{rid}"].do_remote_prefill
        assert kv[f"1_{rid}"] is None and kv[f"2_{rid}"] is None
        first_out = engine.log.index(("out", f"0_{rid}"))
        assert engine.log.index(("start", f"1_{rid}")) > first_out
        assert engine.log.index(("start", f"2_{rid}")) > first_out


def test_pd_refusals(make_server: ServerFactory) -> None:
    engine = FakeEngineClient()
    srv = make_server(engine)
    prefill_kv = signed({"do_remote_decode": True}, "pre")
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"prompt": "q", "max_tokens": 1, "n": 2, "kv_transfer_params": prefill_kv},
        headers={"X-Request-Id": "pre"},
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "n" and "do_remote_decode" in err["message"]
    chat: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1}
    chat["kv_transfer_params"] = signed(DECODE_KV, "dec", prompt_ids_of(srv.url, chat))
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, headers={"X-Request-Id": "dec"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt_logprobs"
    assert "do_remote_prefill" in err["message"]
    assert engine.requests == {}
