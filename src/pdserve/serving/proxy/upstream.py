"""The proxy's HTTP client to its instances: pooled keep-alive connections, and one retry
on a fresh connection when a pooled one turns out to be closed.

Keep-alive: idle pooled connections are closed after :data:`POOL_KEEP_ALIVE_S` (60 s),
before the instances' servers close them (75 s,
:data:`pdserve.serving.uvicorn_server.KEEP_ALIVE_S`). A client that keeps an idle
connection longer than the server does races the server's close: the server closes the
connection just as the client sends a request on it, and that request fails although
the instance is fine. (The proxy used to keep 15 s against uvicorn's 5 s.)

The retry rule (:meth:`Upstream.request`): a request that fails with a connection error
(the peer closed or reset the connection) on a connection **taken from the pool**, before
any response arrived, is sent once more on a **new** connection to the same instance.
That is the signature of a stale pooled connection (an instance with a shorter
keep-alive than ours, e.g. stock uvicorn's 5 s, or a peer that restarted): the server
closed an idle connection, so it never read the request; the bytes the client wrote
went into a socket the server had already closed. Connect errors, timeouts and failures
on a connection that was new are not retried here (the instance is unreachable, slow or
broken; the caller decides). If the instance did die between the two attempts, the new
connection is refused at once, so the retry costs nothing; that refusal is raised as
:class:`ConnectionLost`, never as a connect error: the dropped connection may have
carried the request to the instance before it died (a P/D decode leg may have pulled its
prompt's KV), so the caller must not take it for a request that was never sent.

Each attempt's body comes from ``json_factory`` when one is given, so the retry carries
a fresh signature (signed ``kv_transfer_params`` are single-use: an instance that did
read the first attempt refuses the same params again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp

# Seconds an idle pooled connection to an instance is kept (aiohttp's default is 15).
POOL_KEEP_ALIVE_S = 60.0


@dataclass
class _Attempt:
    """Per-request trace context: was the connection taken from the pool?"""

    reused: bool = False


async def _on_reuse(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object) -> None:
    attempt = ctx.trace_request_ctx
    if isinstance(attempt, _Attempt):
        attempt.reused = True


class ConnectionLost(aiohttp.ClientConnectionError):
    """A pooled connection broke under a request and its instance then refused a new
    one: the instance went away, perhaps after it read the request."""


def stale_connection_error(exc: BaseException) -> bool:
    """A connection closed or reset by the peer (server disconnected, connection reset,
    broken pipe, write to a closing transport); not a connect error, not a timeout."""
    if isinstance(exc, TimeoutError | aiohttp.ClientConnectorError):
        return False
    return isinstance(exc, aiohttp.ClientConnectionError)


class Upstream:
    """Two ``aiohttp`` sessions: ``pooled`` (keep-alive, :data:`POOL_KEEP_ALIVE_S`) for
    every request, ``fresh`` (one new connection per request) for the retry.

    Lifecycle: :meth:`open` in the app's lifespan startup, :meth:`close` at shutdown.
    ``on_retry(url)`` is called for each retry (metrics).
    """

    def __init__(
        self,
        *,
        connect_timeout: float,
        keep_alive: float = POOL_KEEP_ALIVE_S,
        on_retry: Callable[[str], None] | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.keep_alive = keep_alive
        self.on_retry = on_retry
        self._pooled: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None

    @property
    def pooled(self) -> aiohttp.ClientSession:
        if self._pooled is None:
            raise RuntimeError("proxy session is not open (app not started)")
        return self._pooled

    @property
    def is_open(self) -> bool:
        return self._pooled is not None

    def open(self) -> None:
        if self._pooled is not None:
            return
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout)
        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(_on_reuse)
        self._pooled = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=self.keep_alive
            ),
            timeout=timeout,
            trace_configs=[trace],
        )
        self._fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=True),
            timeout=timeout,
        )

    async def close(self) -> None:
        sessions, self._pooled, self._fresh = (self._pooled, self._fresh), None, None
        for s in sessions:
            if s is not None:
                await s.close()

    async def request(
        self,
        method: str,
        url: str,
        *,
        instance: str = "",
        json_factory: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> aiohttp.ClientResponse:
        """``session.request(method, url, **kwargs)`` with the retry rule of the module
        docstring. The caller reads the response and then releases or closes it (it is
        not a context manager here). ``instance`` names the instance for ``on_retry``;
        ``json_factory`` makes each attempt's JSON body."""
        attempt = _Attempt()
        if json_factory is not None:
            kwargs["json"] = json_factory()
        try:
            return await self.pooled.request(method, url, trace_request_ctx=attempt, **kwargs)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not (attempt.reused and stale_connection_error(e)) or self._fresh is None:
                raise
            dropped = e
        if self.on_retry is not None:
            self.on_retry(instance or url)
        if json_factory is not None:
            kwargs["json"] = json_factory()
        try:
            return await self._fresh.request(method, url, **kwargs)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise ConnectionLost(
                f"the connection to {instance or url} broke under the request ({dropped!r}) "
                f"and a new one was refused ({e})"
            ) from e
