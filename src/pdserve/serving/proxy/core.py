"""Shared state and plumbing of the P/D proxy: settings, the upstream session, the
bodies of the two legs, replies, and KV release calls.

See :mod:`pdserve.serving.proxy.forward` for what one request does with them. Error
bodies are :func:`pdserve.serving.http.error_body`, the same as the API server's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.serving.http import error_json
from pdserve.serving.proxy.metrics import ProxyMetrics
from pdserve.serving.proxy.pool import InstancePool

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


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body (a new dict; ``body`` is not modified)."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg's body: the client's, with the prefill's params (or none)."""
    out = dict(body)
    if kv_params is None:
        out.pop("kv_transfer_params", None)
    else:
        out["kv_transfer_params"] = kv_params
    return out


@dataclass(frozen=True)
class ProxySettings:
    """Per-app settings of the legs (seconds). Validated by ``build_proxy_app``."""

    request_timeout: float = 600.0
    connect_timeout: float = 10.0
    release_timeout: float = 5.0
    upstream_api_key: str | None = None


@dataclass
class ProxyCore:
    """What every request of one proxy app shares.

    Lifecycle: built with the app; :meth:`open` (lifespan startup) creates the one
    ``aiohttp.ClientSession``; :meth:`close` (lifespan shutdown) waits up to
    ``release_timeout`` for background release calls, cancels the rest and closes the
    session. ``background`` is owned here: tasks remove themselves when done.
    """

    prefill: InstancePool
    decode: InstancePool
    metrics: ProxyMetrics
    settings: ProxySettings
    _session: aiohttp.ClientSession | None = None
    background: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("proxy session is not open (app not started)")
        return self._session

    async def open(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)

    async def close(self) -> None:
        if self.background:
            _, pending = await asyncio.wait(
                set(self.background), timeout=self.settings.release_timeout
            )
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        session, self._session = self._session, None
        if session is not None:
            await session.close()

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
        """Ask a prefill instance to free the KV it holds for ``request_id``. Never raises."""
        timeout = aiohttp.ClientTimeout(total=self.settings.release_timeout)
        try:
            async with self.session.post(
                prefill_url + RELEASE_PATH,
                json={"request_id": request_id},
                headers=headers,
                timeout=timeout,
            ) as resp:
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
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "timeout", True
    if isinstance(exc, TimeoutError):
        return "timeout", False
    if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError)):
        return "connection_error", True
    return "bad_response", False


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
