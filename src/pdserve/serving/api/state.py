"""Per-app serving state: in-flight accounting, draining, request ids, and the ASGI
middleware that enforces them.

Lifecycle of the app: SERVING → (``begin_drain``, from SIGTERM) DRAINING → stopped by
the server runner (:class:`~pdserve.serving.api.server.ApiServer`). While draining, every endpoint except
``/metrics`` answers 503 and ``/health`` reports 503, so load balancers stop routing here.

Invariants:

* ``in_flight`` counts HTTP requests (except ``/metrics`` and ``/health``) from the
  moment the middleware sees them until the app has sent the last body byte (for SSE:
  the end of the stream). ``wait_idle`` returns when it is zero.
* An engine request id is registered while its HTTP request owns it; a second request
  with the same id (``X-Request-Id``) is rejected with 400 rather than colliding in
  the engine.
* Detached tasks (engine aborts, iterator cleanup) are owned by ``_tasks`` until done,
  so they are never garbage-collected mid-flight.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.metrics.prometheus import PrometheusMetrics
from pdserve.serving.api.errors import APIError
from pdserve.serving.http import (
    MAX_REQUEST_ID_LEN,
    REQUEST_ID_HEADER,
    error_json,
    valid_request_id,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from pdserve.serving.api.chat_template import ChatTemplates
    from pdserve.serving.api.engine_client import EngineClient

logger = logging.getLogger(__name__)

T = TypeVar("T")

# endpoints that are not "work": never counted as in flight
_UNTRACKED_PATHS = frozenset({"/metrics", "/health"})


class ServerState:
    """Draining flag, in-flight count and live engine request ids of one app."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._request_ids: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    # in-flight accounting (called by the middleware)
    def request_started(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no request is in flight within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, timeout))
        except TimeoutError:
            return False
        return True

    def begin_drain(self) -> None:
        self.draining = True

    # engine request ids
    def register(self, request_id: str) -> None:
        if request_id in self._request_ids:
            raise APIError(
                400,
                f"request id {request_id!r} is already used by a request in flight",
                param="X-Request-Id",
            )
        self._request_ids.add(request_id)

    def unregister(self, request_id: str) -> None:
        self._request_ids.discard(request_id)

    def active_request_ids(self) -> list[str]:
        return sorted(self._request_ids)

    # detached tasks
    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        """Run ``coro`` to completion in the background; errors are logged, not raised."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def _done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                logger.warning("%s failed: %r", what, t.exception())

        task.add_done_callback(_done)


@dataclass
class ServingContext:
    """Everything the handlers share. One per app; lives in ``app.state.pdserve``."""

    engine: EngineClient
    served_model_names: list[str]
    metrics: PrometheusMetrics
    chat: ChatTemplates
    enable_prompt_tokens_details: bool
    version: str
    state: ServerState = field(default_factory=ServerState)
    # one worker: tokenizers are not guaranteed thread-safe, and order is preserved.
    # Made on first use and closed at lifespan shutdown (a restarted lifespan remakes it).
    _tokenizer_pool: ThreadPoolExecutor | None = None

    @property
    def default_model(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        """The served name to report; raises 404 for a model this server does not serve."""
        if model is None or model == "":
            return self.default_model
        if model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")
        return model

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run tokenizer / template work off the event loop."""
        if self._tokenizer_pool is None:
            self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenizer")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, partial(fn, *args, **kwargs))

    def abort_soon(self, request_id: str) -> None:
        """Abort an engine request without awaiting (safe inside ``finally`` under cancel)."""
        self.state.spawn(self.engine.abort(request_id), f"abort of {request_id}")

    def abort_all(self) -> int:
        ids = self.state.active_request_ids()
        for rid in ids:
            self.abort_soon(rid)
        return len(ids)

    def close(self) -> None:
        pool, self._tokenizer_pool = self._tokenizer_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def serving_context(app: FastAPI) -> ServingContext:
    """The :class:`ServingContext` of an app made by ``pdserve.serving.api.app.build_app``."""
    ctx = getattr(app.state, "pdserve", None)
    if not isinstance(ctx, ServingContext):
        raise TypeError("app was not built by pdserve.serving.api.app.build_app")
    return ctx


class ServingMiddleware:
    """Pure ASGI middleware (works with SSE, unlike ``BaseHTTPMiddleware``).

    Per HTTP request, in order: validate ``X-Request-Id`` (or mint one) and echo it on
    the response; refuse with 503 while draining (``/metrics`` stays open); require the
    API key on ``/v1/*`` when one is set; count the request as in flight until the app
    returns. Puts ``request_id`` and ``arrival_time`` (``time.monotonic``) in
    ``scope["state"]`` for the handlers.
    """

    def __init__(self, app: ASGIApp, *, state: ServerState, api_key: str | None) -> None:
        self.app = app
        self.state = state
        self._api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival = time.monotonic()
        path: str = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        raw_rid = headers.get(REQUEST_ID_HEADER.encode())
        rid = raw_rid.decode("latin-1") if raw_rid is not None else uuid.uuid4().hex
        if not valid_request_id(rid):
            rid_out = uuid.uuid4().hex
            msg = f"X-Request-Id must be 1-{MAX_REQUEST_ID_LEN} printable ASCII characters"
            await _send_error(send, 400, msg, "X-Request-Id", rid_out)
            return
        if self.state.draining and path != "/metrics":
            await _send_error(send, 503, "server is shutting down", None, rid)
            return
        key = self._api_key
        if key is not None and path.startswith("/v1") and not _authorized(headers, key):
            await _send_error(send, 401, "invalid or missing API key", None, rid)
            return
        scope.setdefault("state", {})
        scope["state"]["request_id"] = rid
        scope["state"]["arrival_time"] = arrival
        rid_header = (REQUEST_ID_HEADER.encode(), rid.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        tracked = path not in _UNTRACKED_PATHS
        if tracked:
            self.state.request_started()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if tracked:
                self.state.request_finished()


def _authorized(headers: dict[bytes, bytes], key: bytes) -> bool:
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


async def _send_error(
    send: Send, status: int, message: str, param: str | None, request_id: str
) -> None:
    body = error_json(status, message, param)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1")),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
