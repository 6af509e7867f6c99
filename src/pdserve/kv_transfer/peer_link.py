"""One decode instance's connection to one prefill instance's KV server.

A :class:`PeerLink` is a ZMQ DEALER socket that handshakes on first use (the peer's
compatibility, engine id and transport payload, all in an authenticated reply) and
then carries one request at a time in the session the handshake opened (each request
numbered one above the last, so none can be replayed), each reply checked against the
topology's secret and bound to its request. It belongs to one thread (ZMQ sockets are not thread-safe):
the puller's worker for that peer. Any failure leaves the link unusable; the worker
closes it and the next job dials and handshakes again (so a restarted prefill is
picked up).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pdserve.core_types.kv_connector import KVPeer
from pdserve.kv_transfer import wire as W
from pdserve.kv_transfer.compat import compat_mismatch
from pdserve.kv_transfer.transports.base import ClientTransport, PendingWrite

_POLL_SLICE_MS = 50  # a wait checks the stop flag this often


class PeerLink:
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
        if not isinstance(msg, W.Handshake):
            self.counter += 1
        tag, head, payload = W.seal_request(self.secret, msg, self.session, self.counter)
        ms = max(1, int(timeout * 1000))
        self.sock.setsockopt(zmq.SNDTIMEO, ms)
        try:
            self.sock.send_multipart([tag, head, payload])
        except zmq.Again:
            raise TimeoutError(f"could not send to the prefill KV server in {timeout:g}s") from None
        deadline = time.monotonic() + timeout
        while not self.sock.poll(min(_POLL_SLICE_MS, ms)):
            if self.stop.is_set():
                raise RuntimeError("the KV puller is shutting down")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from the prefill KV server in {timeout:g}s")
        parts = self.sock.recv_multipart(copy=False)
        return W.open_reply(self.secret, tag, parts)

    def read(self, msg: W.Read, local_block_ids: list[int], timeout: float) -> int:
        """Read blocks and write them into ``local_block_ids``; the bytes moved."""
        return self.start_read(msg, local_block_ids, timeout).wait()

    def start_read(self, msg: W.Read, local_block_ids: list[int], timeout: float) -> PendingWrite:
        """Read blocks and start writing them into ``local_block_ids`` (transports that
        copy asynchronously are still writing when this returns; the socket is free)."""
        t0 = time.monotonic()
        reply, frames = self.request(msg, timeout)
        if isinstance(reply, W.Error):
            raise RuntimeError(reply.message)
        if not isinstance(reply, W.ReadReply):
            raise RuntimeError(f"unexpected read reply {type(reply).__name__}")
        if len(frames) != reply.num_frames or len(reply.block_ids) != msg.num_read:
            raise RuntimeError(
                f"a read reply of {len(frames)} frames for {len(reply.block_ids)} blocks "
                f"({reply.num_frames} frames, {msg.num_read} blocks announced/asked)"
            )
        assert self.transport is not None
        left = max(0.001, timeout - (time.monotonic() - t0))
        return self.transport.begin_write(reply.block_ids, local_block_ids, frames, left)

    def notify(self, msg: W.Done | W.Heartbeat, timeout: float) -> None:
        reply, _ = self.request(msg, timeout)
        if isinstance(reply, W.Error):
            raise RuntimeError(f"prefill refused a {type(msg).__name__.lower()}: {reply.message}")
