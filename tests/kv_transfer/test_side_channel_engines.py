"""The KV side channel of real (in-process) P/D engines under hostile input, a killed
server thread and dead peers (tcp transport, loopback only)."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from _kv_side_channel import RawPeer, error_of, free_port, silent_listener
from _pd_engines import PROMPTS, engine, prefill, proc, run, settle
from _polling import wait_until
from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.core_types import messages as M
from pdserve.core_types.pd_auth import SECRET_ENV, new_secret
from pdserve.core_types.stats import SchedulerStats
from pdserve.engine.engine_core import EngineCore
from pdserve.frontend.async_client import (
    AsyncEngineClient,
    EngineUnhealthyError,
    check_stats_health,
)
from pdserve.kv_transfer import wire as W
from pdserve.kv_transfer.server import KVServer

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def pd(tiny_llama: Path):
    p = engine(tiny_llama, "kv_producer", extra={"lease_seconds": 10.0})
    d = engine(tiny_llama, "kv_consumer", extra={"handshake_timeout": 5.0})
    yield p, d, proc(p, tiny_llama), proc(d, tiny_llama)
    p.shutdown()
    d.shutdown()


def _server(core: EngineCore) -> KVServer:
    srv = core.connector_worker.s.server  # type: ignore[union-attr]
    assert isinstance(srv, KVServer)
    return srv


def _healthy(core: EngineCore) -> SchedulerStats:
    core.step()
    return core.stats()


def _pd_roundtrip(pd: Any, rid: str, ids: list[int]) -> None:
    """One request prefilled on P and decoded on D from the transferred KV."""
    p, d, pp, dp = pd
    before = d.stats().prompt_tokens_by_source["external_kv_transfer"]
    failures = d.stats().kv_transfer_failures
    d.add_request(dp.make_request(rid, ids, SP, prefill(p, pp, rid, ids)))
    out = run(d, {rid})[rid]
    assert out[-1].finish_reason == "length", out[-1].error
    assert d.stats().prompt_tokens_by_source["external_kv_transfer"] == before + len(ids) - 1
    assert d.stats().kv_transfer_failures == failures
    settle(p, d)


def test_hostile_bytes_leave_the_kv_server_serving(pd) -> None:
    p = pd[0]
    port = _server(p).port
    peer = RawPeer(port)
    try:
        assert "expected 3" in error_of(peer.ask([b"x", b"y"]))  # killed main's server
        assert error_of(peer.ask([b"x", b"y", b"z"])) == W.NOT_AUTHENTICATED
        assert "expected 3 frames" in error_of(peer.ask([b""]))  # an empty message
        rng = random.Random(1)
        for _ in range(50):
            peer.send([rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 6))])
        for _ in range(50):
            assert peer.recv() is not None
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(b"\xff" + rng.randbytes(2048))
    finally:
        peer.close()
    assert _server(p).alive
    _pd_roundtrip(pd, "after-garbage", PROMPTS[1])
    st = _healthy(p)
    assert st.kv_transfer_healthy and st.kv_transfer_restarts == 0
    assert sum(st.kv_side_channel_rejected.values()) >= 52


def test_an_unauthenticated_peer_cannot_read_release_or_pin_held_kv(pd) -> None:
    p, d, pp, dp = pd
    ids = PROMPTS[2]
    params = prefill(p, pp, "held", ids)
    n = len(params.remote_block_ids or [])
    held = _healthy(p).kv_held_for_remote_decode
    assert held >= 1
    other = new_secret().encode()
    peer = RawPeer(_server(p).port)
    try:
        msgs: list[W.ToServer] = [
            W.Handshake({}),
            W.Read("held", 0, n, n, params.remote_prompt_digest or "", "evil"),
            W.Done(["held"]),
            W.Heartbeat(["held"] * 100_000),
        ]
        for msg in msgs:
            for frames in ([W.encode(msg)], list(W.seal_request(other, msg))):
                parts = peer.ask(frames)
                assert parts is not None and len(parts) == 2  # an error, no KV frames
                assert b"compat" not in parts[1] and b"engine_id" not in parts[1]
                assert error_of(parts) in (
                    W.NOT_AUTHENTICATED,
                    "expected 3 frames (mac, header, message), got 1",
                )
    finally:
        peer.close()
    for _ in range(3):
        assert _healthy(p).kv_held_for_remote_decode == held  # the forged Done freed nothing
    d.add_request(dp.make_request("held", ids, SP, params))  # the real decode still reads it
    out = run(d, {"held"})["held"]
    assert out[-1].finish_reason == "length" and d.stats().kv_transfer_failures == 0
    settle(p, d)
    assert _healthy(p).kv_side_channel_rejected["unauthenticated"] >= 4


class _Die(BaseException):
    """Escapes every ``except Exception``, as a bug nobody foresaw would."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_killed_kv_server_turns_health_red_until_the_engine_restarts_it(
    pd, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = pd[0]
    srv = _server(p)
    port, restarts = srv.port, _healthy(p).kv_transfer_restarts

    def die(sock: object) -> None:
        raise _Die("injected by the test")

    monkeypatch.setattr(srv, "_serve_one", die)
    peer = RawPeer(port)
    peer.send([b"anything"])
    assert wait_until(lambda: not srv.alive, 5.0)
    peer.close()
    assert wait_until(lambda: not _healthy(p).kv_transfer_healthy, 2.0)
    st = p.stats()
    assert "KV server thread" in st.kv_transfer_unhealthy_reason
    assert "injected by the test" in st.kv_transfer_unhealthy_reason
    # the snapshot the API server gets says so, and its /health check raises
    wire = M.decode_from_engine(M.encode(M.EngineOutputs([], st, 0.0)))
    assert isinstance(wire, M.EngineOutputs) and not wire.stats.kv_transfer_healthy
    with pytest.raises(EngineUnhealthyError, match="KV transfer is down: .*died"):
        check_stats_health(wire.stats)
    monkeypatch.undo()
    assert wait_until(lambda: _healthy(p).kv_transfer_healthy, 5.0)
    st = p.stats()
    assert st.kv_transfer_restarts == restarts + 1 and st.kv_transfer_unhealthy_reason == ""
    assert srv.alive and srv.port == port
    check_stats_health(st)
    _pd_roundtrip(pd, "after-restart", PROMPTS[3])


class _LiveProcess:
    def is_alive(self) -> bool:
        return True


def test_async_client_health_follows_the_latest_snapshot() -> None:
    client = AsyncEngineClient.__new__(AsyncEngineClient)  # no engine process needed
    client._dead = None
    client._procs = [_LiveProcess()]  # type: ignore[list-item]
    client.dp_size = 1
    client._stats = SchedulerStats()
    asyncio.run(client.check_health())
    client._stats = SchedulerStats(
        kv_transfer_healthy=False, kv_transfer_unhealthy_reason="the KV server thread died"
    )
    with pytest.raises(EngineUnhealthyError, match="thread died"):
        asyncio.run(client.check_health())
    client._stats = SchedulerStats(kv_transfer_restarts=1)  # restarted: healthy again
    asyncio.run(client.check_health())


def test_dead_peers_do_not_delay_a_legit_transfer(pd) -> None:
    """Decode pulls with a 5 s handshake timeout; four requests name bad prefill
    endpoints (two that refuse, two that accept TCP and never answer), then a legit
    one arrives: it completes at its usual pace, not behind the bad ones."""
    p, d, pp, dp = pd
    ids = PROMPTS[3]
    with silent_listener() as silent_a, silent_listener() as silent_b:
        template = prefill(p, pp, "template", PROMPTS[0])
        bad = [free_port(), free_port(), silent_a, silent_b]
        for i, port in enumerate(bad):
            params = msgspec.structs.replace(
                template, remote_port=port, remote_request_id=f"bad{i}", remote_engine_id=None
            )
            d.add_request(dp.make_request(f"bad{i}", PROMPTS[0], SP, params))
        d.step()  # their loads are under way
        legit = prefill(p, pp, "legit", ids)
        t0 = time.monotonic()
        d.add_request(dp.make_request("legit", ids, SP, legit))
        out = run(d, {"legit"})["legit"]
        elapsed = time.monotonic() - t0
        print(f"legit P/D transfer beside 4 bad peers: {elapsed:.3f}s")
        assert out[-1].finish_reason == "length"
        assert elapsed < 2.0, f"the legit transfer took {elapsed:.2f}s"
        bad_ids = {f"bad{i}" for i in range(len(bad))}
        outs = run(d, bad_ids, limit=15.0)  # each fails on its own 5 s handshake
        for rid in bad_ids:
            assert outs[rid][-1].finish_reason == "error"
            assert "KV transfer from prefill" in (outs[rid][-1].error or "")
    p.release_kv("template")
    settle(p, d)


def test_a_pd_role_without_the_secret_refuses_to_start(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = EngineConfig.from_kwargs(
        model=str(tiny_llama),
        dtype="float32",
        kv_transfer_config={"kv_connector": "PdConnector", "kv_role": "kv_consumer"},
    )
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(RuntimeError, match=f"{SECRET_ENV}.*pdserve launch sets one"):
        EngineCore(cfg)
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(RuntimeError, match=f"{SECRET_ENV} must be at least 32"):
        EngineCore(cfg)
