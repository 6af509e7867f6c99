"""Shared state and plumbing of the P/D proxy: settings, the upstream client, the
bodies of the two legs (with signed ``kv_transfer_params``), replies, and KV release
calls.

A proxy fronts either a P/D deployment (a prefill and a decode pool) or colocated
instances (one ``colocated`` pool, each request sent whole to one instance); never both
(:func:`pdserve.serving.proxy.app.build_proxy_app` refuses the mix).

See :mod:`pdserve.serving.proxy.forward` for what one request does with them. Error
bodies are :func:`pdserve.serving.http.error_body`, the same as the API server's.

Signing: instances accept ``kv_transfer_params`` only when this topology's proxy signed
them (:mod:`pdserve.core_types.pd_auth`), for the leg's request id, once. The proxy
signs the params it puts on every prefill leg and re-signs the prefill's answer it puts
on the decode leg, each time with a fresh expiry and nonce and bound to the request's
``X-Request-Id``; whatever ``kv_transfer_params`` a client sent never reaches an
instance.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.core_types.pd_auth import sign_kv_params
from pdserve.serving.http import error_json
from pdserve.serving.proxy.metrics import ProxyMetrics
from pdserve.serving.proxy.pool import DEFAULT_FAILURE_THRESHOLD, InstanceDown, InstancePool
from pdserve.serving.proxy.upstream import POOL_KEEP_ALIVE_S, Upstream

logger = logging.getLogger(__name__)

RELEASE_PATH = "/v1/kv_transfer/release"

# What the prefill leg asks for; P answers with its own (do_remote_prefill=True, ...).
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# dropped from the prefill leg: it computes the prompt once and samples one token
_NOT_ON_PREFILL = ("stream_options", "min_tokens", "n", "best_of")


def prefill_body(
    body: dict[str, Any], secret: bytes, request_id: str, path: str = "/v1/completions"
) -> dict[str, Any]:
    """The prefill leg's body (a new dict; ``body`` is not modified), with signed
    :data:`PREFILL_KV_PARAMS`: one sample (``n`` and ``best_of`` left out, so 1) of one
    token (``max_output_tokens`` on ``/v1/responses``); the decode leg gets the client's
    ``n`` and draws the samples, sharing the pulled prompt KV."""
    out = {k: v for k, v in body.items() if k not in _NOT_ON_PREFILL}
    out["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = sign_kv_params(PREFILL_KV_PARAMS, secret, request_id=request_id)
    return out


def decode_body(
    body: dict[str, Any], kv_params: dict[str, Any] | None, secret: bytes, request_id: str
) -> dict[str, Any]:
    """The decode leg's body: the client's, with the prefill's params signed by the proxy
    for ``request_id`` (or without any: also the body of a colocated request)."""
    out = dict(body)
    if kv_params is None:
        out.pop("kv_transfer_params", None)
    else:
        out["kv_transfer_params"] = sign_kv_params(kv_params, secret, request_id=request_id)
    return out


@dataclass(frozen=True)
class ProxySettings:
    """Per-app settings (seconds unless said otherwise). Validated by ``build_proxy_app``.

    ``queue_timeout``: how long a request waits for an instance of a pool when none is
    eligible (none healthy, or the only ones refused its connection), e.g. while the
    launcher restarts the pool's one instance; then 503.
    """

    request_timeout: float = 600.0
    connect_timeout: float = 10.0
    release_timeout: float = 5.0
    queue_timeout: float = 30.0
    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD
    pool_keep_alive: float = POOL_KEEP_ALIVE_S
    upstream_api_key: str | None = None


@dataclass
class ProxyCore:
    """What every request of one proxy app shares.

    ``answer`` is the pool whose answers go to the client: the decode pool of a P/D
    proxy, or the colocated pool; ``prefill`` is the prefill pool, ``None`` for a
    colocated proxy.

    Lifecycle: built with the app; :meth:`open` (lifespan startup) opens the
    :class:`~pdserve.serving.proxy.upstream.Upstream` client; :meth:`close` (lifespan
    shutdown) waits up to ``release_timeout`` for background release calls, cancels the
    rest and closes the client. ``background`` is owned here: tasks remove themselves
    when done. ``secret`` signs ``kv_transfer_params``.
    """

    answer: InstancePool
    prefill: InstancePool | None
    metrics: ProxyMetrics
    settings: ProxySettings
    secret: bytes
    upstream: Upstream = field(init=False)
    background: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        def on_retry(url: str) -> None:
            for pool in self.pools:
                if any(i.url == url for i in pool.instances):
                    self.metrics.stale_connection_retry(pool.role)

        self.upstream = Upstream(
            connect_timeout=self.settings.connect_timeout,
            keep_alive=self.settings.pool_keep_alive,
            on_retry=on_retry,
        )

    @property
    def colocated(self) -> bool:
        """True for a proxy in front of colocated instances (no prefill leg)."""
        return self.prefill is None

    @property
    def pools(self) -> tuple[InstancePool, ...]:
        """Every pool: ``(prefill, decode)`` or ``(colocated,)``."""
        return (self.answer,) if self.prefill is None else (self.prefill, self.answer)

    @property
    def decode(self) -> InstancePool:
        """The decode pool of a P/D proxy (``answer``)."""
        if self.prefill is None:
            raise AttributeError("a colocated proxy has no decode pool (see `answer`)")
        return self.answer

    async def open(self) -> None:
        self.upstream.open()

    async def close(self) -> None:
        if self.background:
            _, pending = await asyncio.wait(
                set(self.background), timeout=self.settings.release_timeout
            )
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self.upstream.close()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def upstream_headers(self, request_id: str, authorization: str | None) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        if self.settings.upstream_api_key is not None:
            headers["Authorization"] = f"Bearer {self.settings.upstream_api_key}"
        elif authorization:
            headers["Authorization"] = authorization
        return headers

    def leg_timeout(self, *, streaming: bool) -> aiohttp.ClientTimeout:
        """Non-streaming legs: ``request_timeout`` in total. Streams: no total limit, but
        at most ``request_timeout`` between two reads."""
        s = self.settings
        return aiohttp.ClientTimeout(
            total=None if streaming else s.request_timeout,
            sock_connect=s.connect_timeout,
            sock_read=s.request_timeout,
        )

    async def release_kv(self, prefill_url: str, request_id: str, headers: dict[str, str]) -> None:
        """Ask a prefill instance to free the KV it holds for ``request_id`` (a body signed
        like ``kv_transfer_params``: instances take releases from this proxy only). Never
        raises."""
        timeout = aiohttp.ClientTimeout(total=self.settings.release_timeout)
        try:
            resp = await self.upstream.request(
                "POST",
                prefill_url + RELEASE_PATH,
                instance=prefill_url,
                json=sign_kv_params({"request_id": request_id}, self.secret),
                headers=headers,
                timeout=timeout,
            )
            async with resp:
                await resp.read()
                if resp.status == 404:
                    logger.debug("%s has no %s (request %s)", prefill_url, RELEASE_PATH, request_id)
                elif resp.status >= 300:
                    logger.warning(
                        "KV release of request %s on %s answered %d",
                        request_id,
                        prefill_url,
                        resp.status,
                    )
        except (aiohttp.ClientError, TimeoutError, OSError, RuntimeError) as e:
            logger.warning("KV release of request %s on %s failed: %r", request_id, prefill_url, e)


def classify_error(exc: BaseException) -> tuple[str, bool]:
    """``(outcome, instance_is_unreachable)`` for an exception raised by a leg."""
    if isinstance(exc, InstanceDown):
        return "instance_down", False  # already marked down
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "timeout", True
    if isinstance(exc, TimeoutError):
        return "timeout", False
    if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError)):
        return "connection_error", True
    return "bad_response", False


def not_sent(exc: BaseException) -> bool:
    """True if the request cannot have reached the instance: the connection was never
    established (refused, unreachable, connect timeout)."""
    return isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)


def status_outcome(status: int) -> str:
    if 200 <= status < 300:
        return "success"
    return "client_error" if 400 <= status < 500 else "server_error"


@dataclass
class Reply:
    """A complete (non-streamed) answer to the client."""

    status: int
    body: bytes
    content_type: str = "application/json"

    @classmethod
    def error(cls, status: int, message: str) -> Reply:
        return cls(status, error_json(status, message))
