"""Run an app from :func:`~pdserve.serving.api.app.build_app` under uvicorn, with
graceful SIGTERM/SIGINT draining.

The runner is the shared :class:`~pdserve.serving.uvicorn_server.UvicornServer`; what
:class:`ApiServer` adds is the engine-aware drain. Shutdown sequence (first SIGTERM or
SIGINT, or :meth:`ApiServer.request_shutdown`):

1. the app starts draining: new requests on every endpoint except ``/metrics`` get
   503 with an OpenAI error body, ``/health`` included, so balancers move away;
2. requests in flight run to completion, for at most ``shutdown_timeout`` seconds;
3. whatever is still running then is aborted in the engine (streams end with
   ``finish_reason="abort"`` and ``[DONE]``), with a short grace period;
4. uvicorn stops and :meth:`ApiServer.serve` returns normally, so the process can
   exit 0. Uvicorn's own signal capture is disabled (it would re-raise the signal
   after shutdown and the process would die with 143).

A second signal while draining forces uvicorn to stop at once (and aborts every
engine request still registered).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pdserve.serving.api.state import serving_context
from pdserve.serving.uvicorn_server import UvicornServer

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

_ABORT_GRACE_S = 5.0


class ApiServer(UvicornServer):
    """One uvicorn server for one API app; see the module docstring for the lifecycle.

    ``port=0`` binds an ephemeral port; :attr:`port` tells which after :meth:`bind`
    (``serve`` binds if nobody did). ``request_shutdown`` may be called from any thread.
    Signal handlers are installed only when serving in the main thread. The access
    log is on by default (as in vLLM); ``access_log=False`` turns it off.
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
        access_log: bool = True,
        **uvicorn_kwargs: Any,
    ) -> None:
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout}")
        self.ctx = serving_context(app)
        self.shutdown_timeout = shutdown_timeout
        kwargs: dict[str, Any] = {"timeout_graceful_shutdown": _ABORT_GRACE_S}
        kwargs.update(uvicorn_kwargs)
        super().__init__(
            app,
            host=host,
            port=port,
            log_level=log_level,
            install_signal_handlers=install_signal_handlers,
            access_log=access_log,
            **kwargs,
        )

    async def drain(self) -> None:
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

    def on_force_stop(self) -> None:
        self.ctx.abort_all()


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
