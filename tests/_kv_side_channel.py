"""Helpers for the KV side-channel tests: a raw (possibly hostile) peer, a real KV server
over small CPU caches, a peer that accepts TCP and never answers, a port nobody uses."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import zmq

from _ipc_peer import filled_caches
from pdserve.core_types.cache_spec import CacheLayout, KVCacheConfig
from pdserve.forward_context import KVCaches
from pdserve.kv_transfer import wire as W
from pdserve.kv_transfer.handler import KVRequestHandler, ServerLimits
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.server import KVServer
from pdserve.kv_transfer.transports.tcp import TcpServer

NUM_BLOCKS = 8
COMPAT = {"connector_version": 4, "block_size": 4, "model_config_hash": "test"}


def cache_config() -> KVCacheConfig:
    return KVCacheConfig.from_layers(
        4, [("l0.attn", "attn", CacheLayout("gqa", "float32", (2, 1, 4, 1, 4), block_axis=1))]
    )


def caches(seed: int | None = 0) -> KVCaches:
    cfg = cache_config()
    if seed is None:
        return KVCaches.allocate(cfg, NUM_BLOCKS, torch.device("cpu"))
    return filled_caches(cfg, NUM_BLOCKS, "cpu", seed)


def kv_server(
    secret: bytes, leases: LeaseTable, limits: ServerLimits | None = None, port: int = 0
) -> KVServer:
    handler = KVRequestHandler(
        secret, "prefill-0", COMPAT, TcpServer(caches()), leases, limits or ServerLimits()
    )
    return KVServer(handler, "127.0.0.1", port)


def holding_server(secret: bytes, held: list[int], rid: str = "r0") -> Iterator[KVServer]:
    """A prefill's KV server whose lease ``rid`` holds blocks ``held`` (a fixture body:
    ``yield from``); closed after."""
    leases = LeaseTable(30.0)
    leases.add(rid, held)
    srv = kv_server(secret, leases)
    yield srv
    srv.close()


class RawPeer:
    """A DEALER that sends whatever frames it is given (no MAC unless asked). Its
    authenticated calls (:meth:`call`) run in one side-channel session, opened by a
    handshake on first use; :attr:`sent` keeps every sealed request (to replay one)."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.session = W.NO_SESSION
        self.counter = 0
        self.sent: list[list[bytes]] = []

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float = 2.0) -> list[bytes] | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return self.sock.recv_multipart()

    def ask(self, frames: list[bytes], timeout: float = 2.0) -> list[bytes] | None:
        self.send(frames)
        return self.recv(timeout)

    def seal(self, secret: bytes, msg: W.ToServer) -> list[bytes]:
        """The frames of an authenticated request, next in this peer's session."""
        if isinstance(msg, W.Handshake):
            frames = list(W.seal_request(secret, msg))
        else:
            self.counter += 1
            frames = list(W.seal_request(secret, msg, self.session, self.counter))
        self.sent.append(frames)
        return frames

    def call(self, secret: bytes, msg: W.ToServer) -> tuple[W.FromServer, list]:
        """An authenticated request (after a handshake, if none was made yet); the
        verified reply."""
        if not isinstance(msg, W.Handshake) and self.session == W.NO_SESSION:
            reply, _ = self.call(secret, W.Handshake(COMPAT, W.client_nonce()))
            assert isinstance(reply, W.HandshakeReply), reply
        return self.replay(secret, self.seal(secret, msg))

    def replay(self, secret: bytes, frames: list[bytes]) -> tuple[W.FromServer, list]:
        """Send ``frames`` (sealed earlier) as they are; the verified reply."""
        parts = self.ask(frames)
        assert parts is not None, "no reply"
        reply, bulk = W.open_reply(secret, frames[0], parts)
        if isinstance(reply, W.HandshakeReply):
            self.session, self.counter = reply.session, 0
        return reply, bulk

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def error_of(parts: list[bytes] | None) -> str:
    """The message of an (unsigned) error reply."""
    assert parts is not None, "no reply"
    assert len(parts) == 2 and parts[0] == b"", parts
    msg = W.decode_from_server(parts[1])
    assert isinstance(msg, W.Error), msg
    return msg.message


def free_port() -> int:
    """A loopback port nothing listens on (a dead peer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def silent_listener() -> Iterator[int]:
    """A port that accepts TCP connections (the kernel completes them) and never
    says a word: a peer that hangs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield int(s.getsockname()[1])
