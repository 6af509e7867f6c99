"""The prefill instance's KV server: a ZMQ ROUTER thread answering decode instances.

It answers handshakes (compatibility info + transport payload), reads of leased blocks,
heartbeats (lease renewals) and done notices (read complete or never-to-be-read). It
never frees blocks itself: done notices are queued in the lease table and the
scheduler frees them on its next step.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from pdserve.kv_transfer import wire as W
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.transports.base import ServerTransport

logger = logging.getLogger(__name__)


class KVServer:
    def __init__(
        self,
        engine_id: str,
        compat: dict[str, Any],
        transport: ServerTransport,
        leases: LeaseTable,
        host: str,
        port: int,
    ) -> None:
        self.engine_id = engine_id
        self.compat = compat
        self.transport = transport
        self.leases = leases
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, payload = self._sock.recv_multipart()
            try:
                reply, frames = self._handle(W.decode_to_server(payload))
            except Exception as e:  # a bad message must not kill the server
                logger.exception("KV server: request failed")
                reply, frames = W.Error(f"{type(e).__name__}: {e}"), []
            self._sock.send_multipart([ident, W.encode(reply), *frames], copy=False)

    def _handle(self, msg: W.ToServer) -> tuple[W.FromServer, list[Any]]:
        if isinstance(msg, W.Handshake):
            return W.HandshakeReply(
                self.engine_id, self.compat, self.transport.transport_info()
            ), []
        if isinstance(msg, W.Heartbeat):
            self.leases.renew(msg.request_ids)
            return W.Ack(), []
        if isinstance(msg, W.Done):
            for rid in msg.request_ids:
                self.leases.finish(rid)
            return W.Ack(), []
        if isinstance(msg, W.Read):
            held = self.leases.begin_read(msg.request_id)
            if held is None:
                return W.Error(
                    f"prefill no longer holds the KV of request {msg.request_id!r} "
                    "(its lease expired or it was released)"
                ), []
            try:
                if len(held) != msg.num_blocks:
                    return W.Error(
                        f"request {msg.request_id!r}: prefill holds {len(held)} blocks, decode expects "
                        f"{msg.num_blocks} (do both instances tokenize the prompt the same way?)"
                    ), []
                ids = held[msg.first_block : msg.first_block + msg.num_read]
                frames = self.transport.read(ids) if ids else []
                return W.ReadReply(ids, len(frames)), frames
            finally:
                self.leases.end_read(msg.request_id)
        return W.Error(f"unexpected message {type(msg).__name__}"), []

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._ctx.term()
