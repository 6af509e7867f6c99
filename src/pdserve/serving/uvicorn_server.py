"""The one uvicorn runner of pdserve's HTTP servers (API server and P/D proxy).

Lifecycle of a :class:`UvicornServer`:

1. :meth:`~UvicornServer.bind` (or ``serve``, if nobody did) binds the listening socket
   with :func:`~pdserve.serving.net.bind_tcp`; ``port=0`` binds an ephemeral port and
   :attr:`~UvicornServer.port` tells which.
2. :meth:`~UvicornServer.serve` runs uvicorn on that socket; :attr:`started` is set once
   uvicorn accepts connections.
3. The first SIGTERM or SIGINT (or :meth:`~UvicornServer.request_shutdown`, from any
   thread, even before ``serve``) runs :meth:`~UvicornServer.drain` (a subclass hook;
   by default nothing) and then tells uvicorn to exit: it stops accepting, waits up to
   ``timeout_graceful_shutdown`` for open connections and cancels the rest.
4. ``serve`` returns normally (the socket is closed), so the process can exit 0.
   Uvicorn's own signal capture is disabled: it would re-raise the signal after
   shutdown and the process would die with 143.

A second shutdown request while draining forces uvicorn to stop at once (after the
:meth:`~UvicornServer.on_force_stop` hook). Signal handlers are installed only when
serving in the main thread.

Access log: ``access_log=True`` logs one line per request on the ``uvicorn.access``
logger at INFO, whatever ``log_level`` says (``log_level`` then governs uvicorn's other
messages); ``access_log=False`` (the default here; the API server turns it on) logs none.

Keep-alive: an idle connection stays open :data:`KEEP_ALIVE_S` (75 s) instead of
uvicorn's 5 s. A client that pools connections must close an idle one before the server
does, or its next request can race the server's close and fail; 75 s is longer than the
pools of the clients that talk to pdserve servers (the P/D proxy keeps idle upstream
connections 60 s, ``pdserve.serving.proxy.upstream``; browsers, aiohttp and common load
balancers keep them 60 s or less). An idle connection costs a file descriptor and a few
KB, so holding it longer is cheap. ``timeout_keep_alive`` in ``uvicorn_kwargs`` overrides it.

Connection limits (:mod:`pdserve.serving.conn_limits`): a request's headers must arrive
within ``header_timeout`` of its first byte, its body within ``body_timeout`` of its
headers (else 408 and the connection is closed), a connection that never sends a byte
is closed after the keep-alive timeout, and at most ``max_idle_connections`` idle
connections are kept (``limits``, :class:`~pdserve.serving.conn_limits.ConnectionLimits`;
both servers' ``--header-timeout``, ``--body-timeout`` and ``--max-idle-connections``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import uvicorn

from pdserve.serving.conn_limits import ConnectionLimits, protocol_class
from pdserve.serving.net import bind_tcp

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# Seconds an idle keep-alive connection stays open (uvicorn's default is 5); see the
# module docstring for why it is longer than any client pool in front of it.
KEEP_ALIVE_S = 75


class _Uvicorn(uvicorn.Server):
    """Uvicorn without its own signal handling (``UvicornServer`` installs its own)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class UvicornServer:
    """One uvicorn server for one app; see the module docstring for the lifecycle.

    ``uvicorn_kwargs`` go to ``uvicorn.Config`` (e.g. ``timeout_graceful_shutdown``,
    ``timeout_keep_alive``, which defaults to :data:`KEEP_ALIVE_S`); ``limits`` are the
    connection limits (default :class:`ConnectionLimits`'s).
    """

    def __init__(
        self,
        app: FastAPI,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        log_level: str = "info",
        install_signal_handlers: bool = True,
        access_log: bool = False,
        limits: ConnectionLimits | None = None,
        **uvicorn_kwargs: Any,
    ) -> None:
        self.app = app
        self.limits = limits or ConnectionLimits()
        self.access_log = access_log
        self.host = host
        self.requested_port = port
        self.log_level = log_level
        self.install_signal_handlers = install_signal_handlers
        self.uvicorn_kwargs = {
            "timeout_keep_alive": KEEP_ALIVE_S,
            "http": protocol_class(self.limits),
            **uvicorn_kwargs,
        }
        self.started = threading.Event()  # set once uvicorn accepts connections
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: _Uvicorn | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._shutdown_early = False

    @property
    def port(self) -> int:
        if self._sock is None:
            raise RuntimeError("not bound yet; call bind() or serve() first")
        return int(self._sock.getsockname()[1])

    def bind(self) -> socket.socket:
        """Bind the listening socket (once); raises ``OSError`` if the port is taken."""
        if self._sock is None:
            sock = bind_tcp(self.host, self.requested_port)
            sock.set_inheritable(True)
            self._sock = sock
        return self._sock

    async def serve(self) -> None:
        """Serve until shut down; returns normally after a graceful shutdown."""
        sock = self.bind()
        self._loop = asyncio.get_running_loop()
        config = uvicorn.Config(
            self.app,
            log_level=self.log_level,
            lifespan="on",
            access_log=self.access_log,
            **self.uvicorn_kwargs,
        )
        if self.access_log:  # Config set it to log_level; access lines are INFO
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        self._server = _Uvicorn(config)
        installed = self._install_signal_handlers()
        try:
            if self._shutdown_early:
                self._start_drain()
            serve_task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
            while not serve_task.done() and not self._server.started:
                await asyncio.wait((serve_task,), timeout=0.01)
            if self._server.started:
                self.started.set()
            await serve_task
        finally:
            for sig in installed:
                self._loop.remove_signal_handler(sig)
            if self._drain_task is not None and not self._drain_task.done():
                self._drain_task.cancel()
            sock.close()
            self._sock = None

    def request_shutdown(self) -> None:
        """What SIGTERM does: drain, then stop. Thread-safe; idempotent (a repeat while
        draining forces the stop)."""
        loop = self._loop
        if loop is None:
            self._shutdown_early = True
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._start_drain()
        else:
            loop.call_soon_threadsafe(self._start_drain)

    # -- hooks --------------------------------------------------------------------------

    async def drain(self) -> None:
        """Runs between the first shutdown request and uvicorn's exit (default: nothing;
        uvicorn's graceful shutdown then lets open connections finish)."""

    def on_force_stop(self) -> None:
        """Runs when a second shutdown request forces the stop (default: nothing)."""

    # -- internals ----------------------------------------------------------------------

    def _install_signal_handlers(self) -> list[signal.Signals]:
        if not self.install_signal_handlers:
            return []
        loop = self._loop
        if loop is None or threading.current_thread() is not threading.main_thread():
            return []
        installed = []
        for sig in _HANDLED_SIGNALS:
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not on this platform
                continue
            installed.append(sig)
        return installed

    def _on_signal(self, sig: signal.Signals) -> None:
        logger.info("received %s: draining", sig.name)
        self._start_drain()

    def _start_drain(self) -> None:
        server = self._server
        if server is None:
            self._shutdown_early = True
            return
        if self._drain_task is not None:
            logger.warning("second shutdown request: stopping now")
            server.should_exit = True
            server.force_exit = True
            self.on_force_stop()
            return
        self._drain_task = asyncio.ensure_future(self._drain_then_stop(server))

    async def _drain_then_stop(self, server: _Uvicorn) -> None:
        await self.drain()
        server.should_exit = True
