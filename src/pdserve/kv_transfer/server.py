"""The prefill instance's KV server: a ZMQ ROUTER thread answering decode instances.

It answers handshakes (compatibility info + transport payload), reads of leased blocks,
heartbeats (lease renewals) and done notices (read complete or never-to-be-read), each
authenticated with the topology's secret (see ``wire`` for the frames and
``handler`` for the checks and bounds). It never frees blocks itself: done notices are
queued in the lease table and the scheduler frees them on its next step.

Lifecycle: the constructor binds (``port`` 0: an ephemeral port, kept from then on) and
starts the thread. Every receive and send is inside the thread's error handling, so no
input stops it; should the thread die anyway (:attr:`alive` false, :attr:`death` says
why; it also gives up on a socket that failed 100 times in a row), :meth:`restart`
re-binds the same port and starts a new one (the connector's supervisor calls it).
:meth:`close` stops it for good.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import zmq

from pdserve.kv_transfer.handler import KVRequestHandler

logger = logging.getLogger(__name__)

_POLL_MS = 100
_BASE_MESSAGE_BYTES = 1 << 20
_BYTES_PER_ID = 512  # room per request id in a heartbeat / done notice
_RCVHWM = 64  # messages queued per connection before libzmq stops reading it
_KEEP_FRAMES = 5  # identity + tag + header + payload, and one more to see it is too many
_BIND_TRIES = 10
_MAX_FAILURES_IN_A_ROW = 100


WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def advertised_host(bind_host: str, advertise: str | None = None) -> str:
    """The address decode instances dial for a KV server bound to ``bind_host``: the
    ``advertise_host`` given, else the bind address itself, else (a wildcard bind) the
    address this machine's default route leaves from (no packet is sent), else
    127.0.0.1 with a warning (only decode instances on this machine can then reach it)."""
    if advertise:
        return advertise
    if bind_host not in WILDCARDS:
        return bind_host
    family, probe = (
        (socket.AF_INET6, "2001:db8::1") if ":" in bind_host else (socket.AF_INET, "192.0.2.1")
    )
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))  # UDP: picks the route, sends nothing
            addr = str(s.getsockname()[0])
    except OSError:
        addr = ""
    if addr and not addr.startswith("127.") and addr != "::1":
        logger.info("KV server bound to %r advertises %s", bind_host, addr)
        return addr
    logger.warning(
        "KV server bound to %r found no routable address to advertise; decode instances "
        "on other hosts cannot reach it (set kv_connector_extra_config.advertise_host)",
        bind_host,
    )
    return "127.0.0.1" if family == socket.AF_INET else "::1"


class KVServer:
    def __init__(self, handler: KVRequestHandler, host: str, port: int) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        self.death: str | None = None  # why the last thread died
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._open()
        self._start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def closed(self) -> bool:
        """:meth:`close` was called (stopped for good: nothing to restart)."""
        return self._stop.is_set()

    def _open(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # control messages are small: a peer sending a bigger one is disconnected
        limit = _BASE_MESSAGE_BYTES + _BYTES_PER_ID * self.handler.limits.max_ids_per_message
        sock.setsockopt(zmq.MAXMSGSIZE, limit)  # (per frame)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        try:
            if self.port:
                sock.bind(f"tcp://{self.host}:{self.port}")
            else:
                self.port = sock.bind_to_random_port(f"tcp://{self.host}")
        except Exception:
            sock.close(linger=0)
            raise
        self._sock = sock

    def _start(self) -> None:
        self.death = None
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-server", daemon=True)
        self._thread.start()

    def release_port(self) -> None:
        """Close a dead thread's socket, so that the port is free again by the time
        :meth:`restart` binds it (libzmq closes a listener asynchronously)."""
        if not self.alive and self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def restart(self) -> None:
        """Re-bind the same port and start a new thread (after the last one died)."""
        if self.alive:
            return
        if self.closed:
            raise RuntimeError("the KV server was closed")
        self.release_port()
        for attempt in range(_BIND_TRIES):
            try:
                self._open()
                break
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or attempt == _BIND_TRIES - 1:
                    raise
                time.sleep(0.02)  # the old listener is still being closed
        self._start()
        logger.warning("KV server restarted on %s:%d", self.host, self.port)

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        failures = 0  # in a row: a socket that keeps failing is replaced (by a restart)
        try:
            while not self._stop.is_set():
                try:
                    if poller.poll(_POLL_MS):
                        self._serve_one(sock)
                    failures = 0
                except zmq.ContextTerminated:
                    return
                except zmq.Again:  # polled readable, nothing there after all
                    continue
                except Exception:  # never let one message (or a socket hiccup) stop the loop
                    logger.exception("KV server: failed to serve a message")
                    failures += 1
                    if failures >= _MAX_FAILURES_IN_A_ROW:
                        self.death = f"its socket failed {failures} times in a row"
                        return
                    time.sleep(0.01)
        except BaseException as e:
            self.death = f"{type(e).__name__}: {e}"
            raise

    def _serve_one(self, sock: zmq.Socket) -> None:
        frames = [sock.recv(zmq.NOBLOCK)]
        while sock.getsockopt(zmq.RCVMORE):  # the parts of a message arrive together
            part = sock.recv()
            if len(frames) < _KEEP_FRAMES:  # more is malformed anyway: do not hoard them
                frames.append(part)
        reply = self.handler.handle_frames(frames)
        if reply:
            sock.send_multipart(reply, zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            if self._thread.is_alive():  # its socket is still in use: leave it to the exit
                logger.warning("KV server thread did not stop in time")
                return
        self._sock = None
        self._ctx.destroy(linger=0)  # closes the socket too
