"""A transport that reads prefill's memory itself (cuda_ipc, nixl) starts the copy from
the block ids prefill's params named, before the read's reply: the copy overlaps the
round trip. A reply naming other ids copies again from those; a refusal lets the early
copy land before the read fails (nothing keeps writing into blocks decode frees).
Loopback only; the "remote memory" is a CPU copy of the prefill server's caches."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from _kv_side_channel import COMPAT, caches, holding_server
from _polling import wait_until
from pdserve.core_types.kv_connector import KVLoad, KVPeer
from pdserve.core_types.pd_auth import new_secret
from pdserve.forward_context import KVCaches
from pdserve.kv_transfer import wire as W
from pdserve.kv_transfer.peer_link import PeerLink
from pdserve.kv_transfer.puller import KVPuller, LoadResult
from pdserve.kv_transfer.server import KVServer
from pdserve.kv_transfer.transports.base import ClientTransport, Fence, PendingWrite
from pdserve.kv_transfer.transports.tcp import TcpServer

SECRET = new_secret().encode()
HELD = [5, 1, 2]
LOCAL = [0, 3, 4]


class RemoteMemoryClient(ClientTransport):
    """Copies blocks from the prefill's caches (an identical CPU copy) by id, as a
    cuda_ipc client does over mapped memory; records each copy, the fence it was given
    (if any) and when it was waited."""

    reads_remote_memory = True

    def __init__(self, kv_caches: KVCaches, info: dict[str, Any], log: list[str]) -> None:
        super().__init__(kv_caches, info)
        self.remote = caches()  # what the prefill server holds (same seed)
        self.log = log

    def begin_write(
        self,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        frames: list[Any],
        timeout: float = 60.0,
        *,
        after: Fence | None = None,
    ) -> PendingWrite:
        if after is not None:
            self.log.append(f"after {after}")
        self.log.append(f"copy {remote_block_ids} frames={len(frames)}")
        n = self.write(remote_block_ids, local_block_ids, frames)

        def wait() -> int:
            self.log.append(f"landed {remote_block_ids}")
            return n

        return PendingWrite(wait)

    def write(self, remote_block_ids: list[int], local_block_ids: list[int], frames: list) -> int:
        for (_, lay, dst), (_, _, src) in zip(
            self.kv_caches.layers(), self.remote.layers(), strict=True
        ):
            for r, loc in zip(remote_block_ids, local_block_ids, strict=True):
                dst.select(lay.block_axis, loc).copy_(src.select(lay.block_axis, r))
        return self.kv_caches.bytes_per_block() * len(local_block_ids)


@pytest.fixture
def prefill() -> Iterator[KVServer]:
    yield from holding_server(SECRET, HELD)


def _pull(
    port: int, remote: str, named: tuple[int, ...], fence: Fence | None = None
) -> tuple[LoadResult, KVCaches, list[str]]:
    dst, log = caches(seed=None), []
    p = KVPuller(COMPAT, lambda info: RemoteMemoryClient(dst, info, log), 5.0, 5.0, SECRET)
    got: list[LoadResult] = []
    try:
        load = KVLoad("a", KVPeer("127.0.0.1", port), remote, LOCAL, 0, len(HELD), "", named)
        p.load(load, fence)
        assert wait_until(lambda: bool(got.extend(p.take_results()) or got), 5.0, 0.005)
    finally:
        p.close()
    return got[0], dst, log


def _blocks(kv: KVCaches, ids: list[int]) -> list[torch.Tensor]:
    return [c.index_select(lay.block_axis, torch.tensor(ids)) for _, lay, c in kv.layers()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_copy_starts_from_the_named_ids_before_the_reply(prefill) -> None:
    res, dst, log = _pull(prefill.port, "r0", tuple(HELD))
    assert res.error is None and res.nbytes == 3 * dst.bytes_per_block()
    assert log == [f"copy {HELD} frames=0", f"landed {HELD}"]  # one copy, no frames needed
    assert _same(_blocks(dst, LOCAL), _blocks(caches(), HELD))


def test_a_reply_with_other_ids_copies_again_from_those(prefill) -> None:
    res, dst, log = _pull(prefill.port, "r0", (1, 2, 3))
    assert res.error is None
    assert log[:2] == ["copy [1, 2, 3] frames=0", "landed [1, 2, 3]"]
    assert log[2] == f"copy {HELD} frames=1"  # the ids prefill holds (after the reply)
    assert _same(_blocks(dst, LOCAL), _blocks(caches(), HELD))


def test_a_refused_read_lets_the_early_copy_land_then_fails(prefill) -> None:
    res, _, log = _pull(prefill.port, "nobody", tuple(HELD))
    assert "no longer holds the KV of request 'nobody'" in (res.error or "")
    assert log == [f"copy {HELD} frames=0", f"landed {HELD}"]  # waited before failing


def test_without_named_ids_the_copy_waits_for_the_reply(prefill) -> None:
    res, _, log = _pull(prefill.port, "r0", ())
    assert res.error is None
    assert log == [f"copy {HELD} frames=1", f"landed {HELD}"]


class _Fence:
    """A stand-in for the connector's CUDA event (the client above only names it)."""

    def wait(self, stream: torch.cuda.Stream) -> None:
        raise AssertionError("not waited here")

    def synchronize(self) -> None:
        raise AssertionError("not waited here")

    def __str__(self) -> str:
        return "fence"


@pytest.mark.parametrize(
    ("remote", "named", "copies"),
    [
        ("r0", tuple(HELD), [f"copy {HELD} frames=0"]),  # the early copy
        ("r0", (1, 2, 3), ["copy [1, 2, 3] frames=0", f"copy {HELD} frames=1"]),  # both
        ("r0", (), [f"copy {HELD} frames=1"]),  # after the reply
        ("nobody", tuple(HELD), [f"copy {HELD} frames=0"]),  # refused: the early one
    ],
)
def test_every_copy_of_a_load_gets_its_fence(
    prefill, remote: str, named: tuple[int, ...], copies: list[str]
) -> None:
    """The early copy (launched before the reply), the copy from the ids the reply
    names and the copy after the reply: the transport is handed the load's fence with
    each (a step in flight may still write into the blocks)."""
    _, _, log = _pull(prefill.port, remote, named, _Fence())
    assert [x for x in log if x.startswith("copy")] == copies
    for i, x in enumerate(log):
        if x.startswith("copy"):
            assert i > 0 and log[i - 1] == "after fence", log


class _ServedLog(TcpServer):
    """The prefill server's transport, logging each read it serves."""

    def __init__(self, kv_caches: KVCaches, log: list[str]) -> None:
        super().__init__(kv_caches)
        self.log = log

    def read(self, block_ids: list[int]) -> list[bytes | memoryview]:
        self.log.append(f"served {block_ids}")
        return super().read(block_ids)


class _LaunchSeesServer(RemoteMemoryClient):
    """Records, at the early copy's launch, whether prefill has served the read yet
    (``wait``: polls for it first, bounded: the read was sent before the launch)."""

    wait = True

    def begin_write(
        self,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        frames: list[Any],
        timeout: float = 60.0,
        *,
        after: Fence | None = None,
    ) -> PendingWrite:
        if not frames:  # the early copy

            def seen() -> bool:
                return any(x.startswith("served") for x in self.log)

            self.log.append(
                f"at launch served={wait_until(seen, 5.0, 0.002) if self.wait else seen()}"
            )
        return super().begin_write(
            remote_block_ids, local_block_ids, frames, timeout, after=after
        )


@pytest.mark.parametrize("send_first", [True, False])
def test_the_read_is_sent_before_the_early_copy_is_launched(prefill, send_first: bool) -> None:
    """The launch (host work, about the round trip's length for short prompts over
    cuda_ipc) runs while the read travels: the request is queued on the socket first.
    ``send_first=False`` is the order before (launch, then send), kept for the bench."""
    log: list[str] = []
    prefill.handler.transport = _ServedLog(caches(), log)
    dst = caches(seed=None)

    def client(info: dict[str, Any]) -> ClientTransport:
        c = _LaunchSeesServer(dst, info, log)
        c.wait = send_first  # launch first: the read cannot have been served yet
        return c

    link = PeerLink(
        zmq.Context.instance(),
        SECRET,
        COMPAT,
        client,
        KVPeer("127.0.0.1", prefill.port),
        threading.Event(),
    )
    link.send_first = send_first
    try:
        link.handshake(5.0)
        n = link.start_read(W.Read("r0", 0, len(HELD), len(HELD)), LOCAL, 5.0, HELD).wait()
    finally:
        link.close()
    assert n == 3 * dst.bytes_per_block()
    launch = next(x for x in log if x.startswith("at launch"))
    assert launch == f"at launch served={send_first}"
    assert log.count(f"served {HELD}") == 1 and log[-1] == f"landed {HELD}"
    assert _same(_blocks(dst, LOCAL), _blocks(caches(), HELD))


@pytest.mark.parametrize(
    ("named", "early"), [(tuple(HELD), True), ((1, 2, 3), False), ((5, 1), False)]
)
def test_the_link_says_whether_the_early_copy_stood(
    prefill, named: tuple[int, ...], early: bool
) -> None:
    """``copied_early`` (what transfer_bench reports as its ``early`` column): the copy
    began before the reply and the reply vouched for it. Not when the reply names other
    ids, nor when the named ids do not cover the read (no early copy is started)."""
    dst, log = caches(seed=None), []
    link = PeerLink(
        zmq.Context.instance(),
        SECRET,
        COMPAT,
        lambda info: RemoteMemoryClient(dst, info, log),
        KVPeer("127.0.0.1", prefill.port),
        threading.Event(),
    )
    try:
        link.handshake(5.0)
        link.start_read(W.Read("r0", 0, len(HELD), len(HELD)), LOCAL, 5.0, named).wait()
    finally:
        link.close()
    assert link.copied_early is early
    assert _same(_blocks(dst, LOCAL), _blocks(caches(), HELD))
