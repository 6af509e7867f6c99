"""Run an app from ``build_app`` under uvicorn, with graceful SIGTERM/SIGINT draining.

Shutdown sequence (first SIGTERM or SIGINT, or :meth:`ApiServer.request_shutdown`):

1. the app starts draining: new requests on every endpoint except ``/metrics`` get
   503 with an OpenAI error body, ``/health`` included, so balancers move away;
2. requests in flight run to completion, for at most ``shutdown_timeout`` seconds;
3. whatever is still running then is aborted in the engine (streams end with
   ``finish_reason="abort"`` and ``[DONE]``), with a short grace period;
4. uvicorn stops and :meth:`ApiServer.serve` returns normally, so the process can
   exit 0. Uvicorn's own signal capture is disabled (it would re-raise the signal
   after shutdown and the process would die with 143).

A second signal while draining forces uvicorn to stop at once.
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

from pdserve.serving.net import bind_tcp

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

_ABORT_GRACE_S = 5.0
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Uvicorn(uvicorn.Server):
    """Uvicorn without its own signal handling (``ApiServer`` installs its own)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class ApiServer:
    """One uvicorn server for one app; see the module docstring for the lifecycle.

    ``port=0`` binds an ephemeral port; :attr:`port` tells which after :meth:`bind`
    (``serve`` binds if nobody did). ``request_shutdown`` may be called from any thread.
    Signal handlers are installed only when serving in the main thread.
    """

    def __init__(
        self,
        app: FastAPI,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        shutdown_timeout: float = 30.0,
        log_level: str = "info",
        install_signal_handlers: bool = True,
        **uvicorn_kwargs: Any,
    ) -> None:
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout}")
        from pdserve.serving.api_server import serving_context

        self.app = app
        self.ctx = serving_context(app)
        self.host = host
        self.requested_port = port
        self.shutdown_timeout = shutdown_timeout
        self.log_level = log_level
        self.install_signal_handlers = install_signal_handlers
        self.uvicorn_kwargs = uvicorn_kwargs
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
        if self._sock is None:
            sock = bind_tcp(self.host, self.requested_port)
            sock.set_inheritable(True)
            self._sock = sock
        return self._sock

    async def serve(self) -> None:
        """Serve until shut down; returns normally after a graceful shutdown."""
        sock = self.bind()
        self._loop = asyncio.get_running_loop()
        kwargs: dict[str, Any] = {"timeout_graceful_shutdown": _ABORT_GRACE_S}
        kwargs.update(self.uvicorn_kwargs)
        config = uvicorn.Config(self.app, log_level=self.log_level, lifespan="on", **kwargs)
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
            self.ctx.abort_all()
            return
        self._drain_task = asyncio.ensure_future(self._drain_then_stop(server))

    async def _drain_then_stop(self, server: _Uvicorn) -> None:
        state = self.ctx.state
        state.begin_drain()
        logger.info(
            "draining %d request(s) in flight (timeout %.1fs)",
            state.in_flight,
            self.shutdown_timeout,
        )
        if not await state.wait_idle(self.shutdown_timeout):
            n = self.ctx.abort_all()
            logger.warning("shutdown timeout: aborted %d engine request(s)", n)
            await state.wait_idle(_ABORT_GRACE_S)
        server.should_exit = True


async def serve_app(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = 30.0,
    *,
    log_level: str = "info",
    **uvicorn_kwargs: Any,
) -> None:
    """Serve ``app`` (from ``build_app``) until SIGTERM/SIGINT, drain, and return."""
    server = ApiServer(
        app,
        host=host,
        port=port,
        shutdown_timeout=shutdown_timeout,
        log_level=log_level,
        **uvicorn_kwargs,
    )
    await server.serve()
