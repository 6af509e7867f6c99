"""The API app's one ASGI middleware: what every HTTP request goes through before a route.

Per request, in order:

1. ``X-Request-Id``: validated (400) or minted, and echoed on the response;
2. draining: 503 on everything but ``/metrics``;
3. the API key (when one is set): every path except :data:`OPEN_PATHS` (``/health``,
   ``/metrics``, ``/version`` and the OpenAPI docs) needs ``Authorization: Bearer <key>``,
   so ``/tokenize`` and ``/detokenize`` are covered like ``/v1/*`` (401);
4. the request-body limit (``--max-request-body-bytes``, 413,
   :mod:`pdserve.serving.body_limit`): a ``Content-Length`` over the limit is refused
   before a byte of the body is read; a body without one (chunked) is read here up to
   the limit and refused as soon as it goes over. The rest of a refused body is
   discarded by the HTTP server as it arrives (nothing is buffered), and the
   connection stays usable;
5. in-flight accounting until the app returns.

It puts ``request_id`` and ``arrival_time`` (``time.monotonic``) in ``scope["state"]``.
Pure ASGI (works with SSE, unlike ``BaseHTTPMiddleware``).
"""

from __future__ import annotations

import hmac
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.serving.api.state import ServerState
from pdserve.serving.body_limit import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    declared_over,
    read_limited,
    replay,
    too_large_message,
)
from pdserve.serving.http import (
    MAX_REQUEST_ID_LEN,
    REQUEST_ID_HEADER,
    send_error_json,
    valid_request_id,
)

__all__ = ["DEFAULT_MAX_REQUEST_BODY_BYTES", "OPEN_PATHS", "ServingMiddleware", "send_error"]

# endpoints that stay open with an API key (as in vLLM): probes, metrics, the docs
OPEN_PATHS = frozenset(
    {"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)
# endpoints that are not "work": never counted as in flight
_UNTRACKED_PATHS = frozenset({"/metrics", "/health"})


class ServingMiddleware:
    """See the module docstring. ``max_body_bytes=None`` disables the body limit."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        state: ServerState,
        api_key: str | None,
        max_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
    ) -> None:
        if max_body_bytes is not None and max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1 or None, got {max_body_bytes}")
        self.app = app
        self.state = state
        self._api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

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
            await send_error(send, 400, msg, "X-Request-Id", rid_out)
            return
        if self.state.draining and path != "/metrics":
            await send_error(send, 503, "server is shutting down", None, rid)
            return
        key = self._api_key
        if key is not None and path not in OPEN_PATHS and not _authorized(headers, key):
            await send_error(send, 401, "invalid or missing API key", None, rid)
            return
        limit = self.max_body_bytes
        declared = headers.get(b"content-length")
        if limit is not None and declared_over(declared, limit):
            await send_error(send, 413, too_large_message(limit, declared), None, rid)
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
            if limit is not None and declared is None and b"transfer-encoding" in headers:
                body = await read_limited(receive, limit)
                if body is None:
                    await send_error(send, 413, too_large_message(limit), None, rid)
                    return
                receive = replay(body, receive)
            await self.app(scope, receive, send_with_id)
        finally:
            if tracked:
                self.state.request_finished()


def _authorized(headers: dict[bytes, bytes], key: bytes) -> bool:
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


async def send_error(
    send: Send, status: int, message: str, param: str | None, request_id: str
) -> None:
    """An OpenAI error body straight from the middleware (the app never sees the request)."""
    rid = (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1"))
    await send_error_json(send, status, message, param, [rid])
