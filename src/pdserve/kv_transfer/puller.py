"""The decode instance's transfer thread: handshakes, block reads, heartbeats, done notices.

One thread owns every ZMQ socket to prefill engines (sockets are not thread-safe) and
performs the jobs in order. The scheduler side enqueues jobs once per step and drains
results once per step. A peer that times out or refuses is dropped and handshaken
again on its next job, so a restarted prefill instance is picked up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from pdserve.core_types.kv_connector import KVLoad, KVNotice, KVPeer
from pdserve.kv_transfer import wire as W
from pdserve.kv_transfer.compat import compat_mismatch
from pdserve.kv_transfer.transports.base import ClientTransport

logger = logging.getLogger(__name__)


@dataclass
class LoadResult:
    request_id: str
    error: str | None
    seconds: float
    nbytes: int


@dataclass
class _Peer:
    sock: zmq.Socket
    engine_id: str
    transport: ClientTransport


class KVPuller:
    def __init__(
        self,
        compat: dict[str, Any],
        make_client: Callable[[dict[str, Any]], ClientTransport],
        handshake_timeout: float,
        transfer_timeout: float,
    ) -> None:
        self.compat = compat
        self.make_client = make_client
        self.handshake_timeout = handshake_timeout
        self.transfer_timeout = transfer_timeout
        self._ctx = zmq.Context()
        self._peers: dict[tuple[str, int], _Peer] = {}  # (host, port) -> its connection
        self._jobs: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._results: list[LoadResult] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-puller", daemon=True)
        self._thread.start()

    # -- called from the scheduler thread --------------------------------------------------
    def load(self, job: KVLoad) -> None:
        self._jobs.put(("load", job))

    def notify_done(self, notice: KVNotice) -> None:
        self._jobs.put(("done", notice))

    def heartbeat(self, notice: KVNotice) -> None:
        self._jobs.put(("heartbeat", notice))

    def take_results(self) -> list[LoadResult]:
        with self._lock:
            out, self._results = self._results, []
            return out

    def close(self) -> None:
        self._jobs.put(("stop", None))
        self._thread.join(timeout=5)
        for p in self._peers.values():
            p.sock.close(linger=0)
        self._ctx.term()

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            kind, arg = self._jobs.get()
            if kind == "stop":
                return
            try:
                if kind == "load":
                    self._load(arg)
                elif kind == "done":
                    self._notify(arg.peer, W.Done(arg.request_ids))
                elif kind == "heartbeat":
                    self._notify(arg.peer, W.Heartbeat(arg.request_ids))
            except Exception:  # never let one job kill the thread
                logger.exception("KV puller: %s job failed", kind)

    def _drop(self, addr: tuple[str, int]) -> None:
        peer = self._peers.pop(addr, None)
        if peer is not None:
            peer.sock.close(linger=0)

    def _request(
        self, sock: zmq.Socket, msg: W.ToServer, timeout: float
    ) -> tuple[W.FromServer, list]:
        sock.send(W.encode(msg))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no answer from the prefill KV server in {timeout:g}s")
        parts = sock.recv_multipart(copy=False)
        return W.decode_from_server(parts[0].bytes), parts[1:]

    def _peer(self, target: KVPeer) -> _Peer:
        addr = (target.host, target.port)
        peer = self._peers.get(addr)
        if peer is not None:
            return peer
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{addr[0]}:{addr[1]}")
        try:
            reply, _ = self._request(sock, W.Handshake(self.compat), self.handshake_timeout)
            if isinstance(reply, W.Error):
                raise RuntimeError(f"handshake refused by prefill: {reply.message}")
            if not isinstance(reply, W.HandshakeReply):
                raise RuntimeError(f"unexpected handshake reply {type(reply).__name__}")
            why = compat_mismatch(self.compat, reply.compat)
            if why:
                raise RuntimeError(why)
            expected = target.engine_id
            if expected and expected != reply.engine_id:
                raise RuntimeError(
                    f"prefill at {addr[0]}:{addr[1]} is engine {reply.engine_id}, not {expected} "
                    "(restarted?)"
                )
            peer = _Peer(sock, reply.engine_id, self.make_client(reply.transport_info))
        except Exception:
            sock.close(linger=0)
            raise
        self._peers[addr] = peer
        return peer

    def _notify(self, target: KVPeer, msg: W.ToServer) -> None:
        addr = (target.host, target.port)
        try:
            peer = self._peer(target)
            self._request(peer.sock, msg, self.handshake_timeout)
        except Exception as e:
            logger.warning("KV side channel to %s:%s: %s", addr[0], addr[1], e)
            self._drop(addr)

    def _load(self, job: KVLoad) -> None:
        t0 = time.perf_counter()
        err: str | None = None
        nbytes = 0
        addr = (job.peer.host, job.peer.port)
        try:
            peer = self._peer(job.peer)
            rid = job.remote_request_id
            read = W.Read(rid, job.first_block, len(job.local_block_ids), job.num_blocks)
            reply, frames = self._request(peer.sock, read, self.transfer_timeout)
            if isinstance(reply, W.Error):
                raise RuntimeError(reply.message)
            if not isinstance(reply, W.ReadReply):
                raise RuntimeError(f"unexpected read reply {type(reply).__name__}")
            nbytes = peer.transport.write(reply.block_ids, job.local_block_ids, frames)
            peer.sock.send(W.encode(W.Done([rid])))  # read complete: prefill may free now
            if peer.sock.poll(int(self.handshake_timeout * 1000)):
                peer.sock.recv_multipart()
        except Exception as e:
            err = f"KV transfer from prefill {addr[0]}:{addr[1]} failed: {e}"
            logger.warning("request %s: %s", job.request_id, err)
            self._drop(addr)
        with self._lock:
            self._results.append(LoadResult(job.request_id, err, time.perf_counter() - t0, nbytes))
