"""The load fence: under async scheduling the step in flight may still write one KV slot
into blocks freed while it runs, and a load may have been given them. So the connector
records an event on the engine's stream when it issues loads (on a CUDA cache only),
and the transport writes nothing before it: on its own stream (cuda_ipc, tcp on a GPU)
by making the stream wait, otherwise (nixl, the default) by waiting on the host before
it posts. On the CPU a stand-in event records what is done with it; the GPU tests make
the engine's stale write really race the copy. Loopback only."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from _fake_nixl import FakeFabric
from _kv_side_channel import COMPAT, caches, holding_server
from _polling import wait_until
from pdserve.config import KVTransferConfig
from pdserve.core_types.kv_connector import KVConnectorMetadata, KVLoad, KVPeer
from pdserve.core_types.pd_auth import new_secret
from pdserve.forward_context import KVCaches
from pdserve.kv_transfer.pd_connector import PdConnectorWorker, make_pd_connector
from pdserve.kv_transfer.puller import KVPuller, LoadResult
from pdserve.kv_transfer.server import KVServer
from pdserve.kv_transfer.transports import nixl as N
from pdserve.kv_transfer.transports.tcp import TcpClient

SECRET = new_secret().encode()
HELD = [5, 1, 2]
LOCAL = [0, 3, 4]


class FakeFence:
    """A stand-in for the connector's ``torch.cuda.Event``: records each wait;
    ``on_sync`` runs when the host waits for it (to look at what is written by then)."""

    def __init__(self, on_sync: Callable[[], None] = lambda: None) -> None:
        self.on_sync = on_sync
        self.waits: list[object] = []  # the streams made to wait for it
        self.syncs = 0

    def wait(self, stream: object) -> None:
        self.waits.append(stream)

    def synchronize(self) -> None:
        self.syncs += 1
        self.on_sync()


def _blocks(kv: KVCaches, ids: list[int]) -> list[torch.Tensor]:
    idx = torch.tensor(ids, device=kv.device)
    return [c.index_select(lay.block_axis, idx).cpu() for _, lay, c in kv.layers()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- the connector: a fence on a CUDA cache, none on the CPU --------------------------------
@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[PdConnectorWorker, list]]:
    """A decode connector's worker half over CPU caches, its puller's loads recorded."""
    cfg = KVTransferConfig("PdConnector", "kv_consumer", {"transport": "tcp"})
    _, w = make_pd_connector(cfg, 4, COMPAT, SECRET)
    w.register_kv_caches(caches(seed=None))
    loads: list[tuple[str, object]] = []
    assert w.s.puller is not None
    monkeypatch.setattr(w.s.puller, "load", lambda load, after=None: loads.append((load, after)))
    yield w, loads
    w.shutdown()


def _meta(*rids: str) -> KVConnectorMetadata:
    peer = KVPeer("127.0.0.1", 1)
    return KVConnectorMetadata(loads=[KVLoad(r, peer, r, [0], 0, 1) for r in rids])


def test_on_a_cpu_cache_loads_carry_no_fence(worker) -> None:
    w, loads = worker
    assert w.device.type == "cpu"
    w.start_load_kv(_meta("a", "b"))
    assert [(x.request_id, after) for x, after in loads] == [("a", None), ("b", None)]


def test_on_a_cuda_cache_one_event_on_the_engines_stream_fences_every_load(
    worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded on the calling thread's current stream (the engine's, where the step in
    flight runs) when the loads are issued; none for a step without loads."""
    w, loads = worker
    made: list[SimpleNamespace] = []

    def event() -> SimpleNamespace:
        ev = SimpleNamespace(recorded=[])
        ev.record = ev.recorded.append
        made.append(ev)
        return ev

    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"current {device}")
    w.device = torch.device("cuda", 0)
    w.start_load_kv(_meta())  # heartbeats only: nothing to fence
    assert made == [] and loads == []
    w.start_load_kv(_meta("a", "b"))
    assert len(made) == 1 and made[0].recorded == ["current cuda:0"]
    assert [(x.request_id, after) for x, after in loads] == [("a", made[0]), ("b", made[0])]


# -- transports: stream-ordered ones wait on the device, the others on the host -------------
def test_stream_ordered_clients_make_their_stream_wait_and_never_block() -> None:
    from pdserve.kv_transfer.transports.cuda_ipc import CudaIpcClient

    stream = object()  # a stand-in for the client's side stream
    tcp = TcpClient(caches(seed=None), {})
    tcp._stream = stream  # type: ignore[assignment]  # as on a GPU
    ipc = CudaIpcClient.__new__(CudaIpcClient)  # (its handshake needs a GPU)
    ipc._stream = stream  # type: ignore[assignment]
    for client in (tcp, ipc):
        fence = FakeFence()
        client.order_after(fence)
        assert fence.waits == [stream] and fence.syncs == 0


@pytest.fixture
def prefill() -> Iterator[KVServer]:
    yield from holding_server(SECRET, HELD)


def test_a_write_on_no_stream_waits_on_the_host_before_any_byte_lands(prefill) -> None:
    """tcp on a CPU cache (the default ``order_after``) through the puller: the fence is
    waited for in the puller's thread, before the blocks are written, once."""
    dst = caches(seed=None)
    seen: list[bool] = []
    fence = FakeFence(lambda: seen.append(not any(b.any() for b in _blocks(dst, LOCAL))))
    p = KVPuller(COMPAT, lambda info: TcpClient(dst, info), 5.0, 5.0, SECRET)
    got: list[LoadResult] = []
    try:
        p.load(KVLoad("a", KVPeer("127.0.0.1", prefill.port), "r0", LOCAL, 0, 3), fence)
        assert wait_until(lambda: bool(got.extend(p.take_results()) or got), 5.0, 0.005)
    finally:
        p.close()
    assert got[0].error is None
    assert seen == [True] and fence.waits == []  # waited once, with nothing written yet
    assert _same(_blocks(dst, LOCAL), _blocks(caches(), HELD))


def test_nixl_waits_on_the_host_before_it_posts_the_read() -> None:
    """A READ the NIXL agent posts is ordered on no CUDA stream."""
    fabric = FakeFabric()
    src, dst = caches(), caches(seed=None)
    p_ep = N.NixlEndpoint(src, agent_api=fabric.api())
    d_ep = N.NixlEndpoint(dst, agent_api=fabric.api())
    try:
        client = N.NixlClient(dst, p_ep.info(), d_ep)
        fence = FakeFence(lambda: fabric.log("decode", "fence waited"))
        n = client.begin_write(HELD, LOCAL, [], 5.0, after=fence).wait()
        assert n == 3 * dst.bytes_per_block()
        order = [w for _, w in fabric.calls if w in ("fence waited", "transfer", "read_complete")]
        assert order == ["fence waited", "transfer", "read_complete"]
        assert fence.syncs == 1 and fence.waits == []
        assert _same(_blocks(dst, LOCAL), _blocks(src, HELD))
    finally:
        p_ep.close()
        d_ep.close()


# -- on a GPU: the engine's stale write really races the copy -------------------------------
def _busy_then_stale(dst: KVCaches, ids: list[int]) -> None:
    """The step in flight on the engine's (default) stream: busy for a while, then one
    stale write into blocks a load was given."""
    torch.cuda._sleep(200_000_000)  # a few tens of ms of GPU cycles
    idx = torch.tensor(ids, device=dst.device)
    for _, lay, c in dst.layers():
        c.index_fill_(lay.block_axis, idx, 7)


@pytest.mark.gpu
def test_on_a_gpu_the_connectors_tcp_load_lands_after_the_step_in_flight(prefill) -> None:
    cfg = KVTransferConfig("PdConnector", "kv_consumer", {"transport": "tcp"})
    _, w = make_pd_connector(cfg, 4, COMPAT, SECRET)
    dst = KVCaches.allocate(caches().config, caches().num_blocks, torch.device("cuda"))
    w.register_kv_caches(dst)
    try:
        load = KVLoad("a", KVPeer("127.0.0.1", prefill.port), "r0", LOCAL, 0, 3)
        _busy_then_stale(dst, LOCAL)
        w.start_load_kv(KVConnectorMetadata(loads=[load]))  # its fence: after the stale write
        out: dict[str, Any] = {}
        deadline = time.monotonic() + 30.0
        while "a" not in out and time.monotonic() < deadline:
            got = w.get_finished()
            out |= {r: None for r in got.finished_recving} | dict(got.failed_recving)
            time.sleep(0.005)
        assert out == {"a": None}
        torch.cuda.synchronize()
        assert _same(_blocks(dst, LOCAL), _blocks(caches(), HELD))
    finally:
        w.shutdown()


@pytest.mark.gpu
def test_on_a_gpu_a_fenced_cuda_ipc_copy_lands_after_the_stale_write() -> None:
    import multiprocessing as mp

    from _ipc_peer import export_caches
    from pdserve.kv_transfer.transports.cuda_ipc import CudaIpcClient

    cfg = caches().config
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=export_caches, args=(cfg, 8, 0, child))
    proc.start()
    try:
        assert parent.poll(120), "the exporting process did not answer"
        dst = KVCaches.allocate(cfg, 8, torch.device("cuda"))
        client = CudaIpcClient(dst, parent.recv())
        _busy_then_stale(dst, LOCAL)
        fence = torch.cuda.Event()
        fence.record()
        client.begin_write(HELD, LOCAL, [], after=fence).wait()
        torch.cuda.synchronize()
        assert _same(_blocks(dst, LOCAL), _blocks(caches(), HELD))
    finally:
        parent.send("stop")
        proc.join(30)

