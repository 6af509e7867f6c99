"""One decode instance's connection to one prefill instance's KV server.

A :class:`PeerLink` is a ZMQ DEALER socket that handshakes on first use (the peer's
compatibility, engine id and transport payload, all in an authenticated reply) and
then carries one request at a time in the session the handshake opened (each request
numbered one above the last, so none can be replayed), each reply checked against the
topology's secret and bound to its request. It belongs to one thread (ZMQ sockets are
not thread-safe): the puller's worker for that peer. Any failure leaves the link
unusable; the worker closes it and the next job dials and handshakes again (so a
restarted prefill is picked up). Every copy a read starts carries the load's fence
(``transports.base``), the early copy too.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from pdserve.core_types.kv_connector import KVPeer
from pdserve.kv_transfer import wire as W
from pdserve.kv_transfer.compat import compat_mismatch
from pdserve.kv_transfer.transports.base import ClientTransport, Fence, PendingWrite

_POLL_SLICE_MS = 50  # a wait checks the stop flag this often


class PeerLink:
    # an early copy is launched after the read is sent (its launch overlaps the round
    # trip too); False: launched first (the order before; transfer_bench --variants)
    send_first = True

    def __init__(
        self,
        ctx: zmq.Context,
        secret: bytes,
        compat: dict[str, Any],
        make_client: Callable[[dict[str, Any]], ClientTransport],
        target: KVPeer,
        stop: threading.Event,
    ) -> None:
        self.secret = secret
        self.compat = compat
        self.make_client = make_client
        self.target = target
        self.stop = stop
        self.engine_id: str | None = None
        self.transport: ClientTransport | None = None
        self.session = W.NO_SESSION  # until the handshake opens one
        self.counter = 0  # the last request's number in the session
        self.replied_at = 0.0  # perf_counter() when the last reply arrived (benchmarks)
        self.copied_early = False  # the last start_read's copy began before its reply
        self.sock: zmq.Socket = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{target.host}:{target.port}")

    @property
    def name(self) -> str:
        return f"{self.target.host}:{self.target.port}"

    def close(self) -> None:
        if self.transport is not None:
            transport, self.transport = self.transport, None
            transport.close()
        self.sock.close(linger=0)

    def handshake(self, timeout: float) -> None:
        reply, _ = self.request(W.Handshake(self.compat, W.client_nonce()), timeout)
        if isinstance(reply, W.Error):
            raise RuntimeError(f"handshake refused by prefill: {reply.message}")
        if not isinstance(reply, W.HandshakeReply):
            raise RuntimeError(f"unexpected handshake reply {type(reply).__name__}")
        why = compat_mismatch(self.compat, reply.compat)
        if why:
            raise RuntimeError(why)
        expected = self.target.engine_id
        if expected and expected != reply.engine_id:
            raise RuntimeError(
                f"prefill at {self.name} is engine {reply.engine_id}, not {expected} (restarted?)"
            )
        if len(reply.session) != W.SESSION_BYTES:
            raise RuntimeError("the prefill KV server opened no side-channel session")
        self.transport = self.make_client(reply.transport_info)
        self.engine_id = reply.engine_id
        self.session, self.counter = reply.session, 0

    def request(self, msg: W.ToServer, timeout: float) -> tuple[W.FromServer, list]:
        """Send ``msg``; the authenticated reply and its bulk frames, or an exception
        (``TimeoutError`` after ``timeout`` s, :class:`wire.Refused` for a reply that
        does not verify)."""
        return self._receive(self._send(msg, timeout), timeout)

    def _send(self, msg: W.ToServer, timeout: float) -> tuple[bytes, float]:
        """Queue ``msg`` on the socket (returns at once; libzmq's I/O thread sends it);
        the request's tag and the reply's deadline, for :meth:`_receive`."""
        if not isinstance(msg, W.Handshake):
            self.counter += 1
        tag, head, payload = W.seal_request(self.secret, msg, self.session, self.counter)
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
        try:
            self.sock.send_multipart([tag, head, payload])
        except zmq.Again:
            raise TimeoutError(f"could not send to the prefill KV server in {timeout:g}s") from None
        return tag, time.monotonic() + timeout

    def _receive(self, sent: tuple[bytes, float], timeout: float) -> tuple[W.FromServer, list]:
        tag, deadline = sent
        ms = max(1, int(timeout * 1000))
        while not self.sock.poll(min(_POLL_SLICE_MS, ms)):
            if self.stop.is_set():
                raise RuntimeError("the KV puller is shutting down")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from the prefill KV server in {timeout:g}s")
        parts = self.sock.recv_multipart(copy=False)
        self.replied_at = time.perf_counter()
        return W.open_reply(self.secret, tag, parts)

    def read(
        self,
        msg: W.Read,
        local_block_ids: list[int],
        timeout: float,
        expected_ids: Sequence[int] = (),
    ) -> int:
        """Read blocks and write them into ``local_block_ids``; the bytes moved."""
        return self.start_read(msg, local_block_ids, timeout, expected_ids).wait()

    def start_read(
        self,
        msg: W.Read,
        local_block_ids: list[int],
        timeout: float,
        expected_ids: Sequence[int] = (),
        *,
        after: Fence | None = None,
    ) -> PendingWrite:
        """Read blocks and start writing them into ``local_block_ids`` (transports that
        copy asynchronously are still writing when this returns; the socket is free).

        ``after``: the load's fence (``transports.base``): every copy, the early one
        too, writes nothing before it has completed.

        ``expected_ids``: prefill's ids of the blocks asked for, as its params named
        them. A transport that reads prefill's memory itself starts the copy from them
        right after sending the read (the send only queues it: the copy's launch on the
        host and the copy itself both overlap the round trip). Blocks a lease
        holds stay put from prefill's finish until the done notice, so a reply naming
        the same ids vouches for what the copy read; a refusal (or other ids) waits for
        that copy to land, then fails (or copies again from the ids the reply names):
        nothing is left writing into blocks the caller may free."""
        assert self.transport is not None
        t0 = time.monotonic()
        self.copied_early = False
        early: PendingWrite | None = None
        copy_early = self.transport.reads_remote_memory and len(expected_ids) == msg.num_read > 0
        sent = self._send(msg, timeout) if self.send_first or not copy_early else None
        try:
            if copy_early:
                early = self.transport.begin_write(
                    list(expected_ids), local_block_ids, [], timeout, after=after
                )
            if sent is None:  # (the order before send_first: launch, then send)
                sent = self._send(msg, timeout)
            reply, frames = self._receive(sent, timeout)
            if isinstance(reply, W.Error):
                raise RuntimeError(reply.message)
            if not isinstance(reply, W.ReadReply):
                raise RuntimeError(f"unexpected read reply {type(reply).__name__}")
            if len(frames) != reply.num_frames or len(reply.block_ids) != msg.num_read:
                raise RuntimeError(
                    f"a read reply of {len(frames)} frames for {len(reply.block_ids)} blocks "
                    f"({reply.num_frames} frames, {msg.num_read} blocks announced/asked)"
                )
        except BaseException:
            if early is not None:
                with contextlib.suppress(Exception):
                    early.wait()
            raise
        if early is not None:
            if list(reply.block_ids) == list(expected_ids):
                self.copied_early = True
                return early
            early.wait()  # prefill holds other blocks than its params named: copy those
        left = max(0.001, timeout - (time.monotonic() - t0))
        return self.transport.begin_write(
            reply.block_ids, local_block_ids, frames, left, after=after
        )

    def notify(self, msg: W.Done | W.Heartbeat, timeout: float) -> None:
        reply, _ = self.request(msg, timeout)
        if isinstance(reply, W.Error):
            raise RuntimeError(f"prefill refused a {type(msg).__name__.lower()}: {reply.message}")
