"""The request-body limit both pdserve servers enforce (API server and P/D proxy).

A body over the limit is answered 413 before it is held in memory: a ``Content-Length``
over the limit is refused before a byte of the body is read; a body without one
(chunked) is read up to the limit and refused as soon as it goes over. The rest of a
refused body is discarded by the HTTP server as it arrives (nothing is buffered), and
the connection stays usable.

:class:`BodyLimitMiddleware` (the proxy's; the API server's own middleware uses the
same helpers) also reads the whole body itself and hands the app a replay of it, so a
client that disconnects mid-upload ends the request quietly: no response, no traceback.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# 32 MiB: a prompt of token ids costs at most 8 bytes per token in JSON ("151643, "), so
# this admits about 4 million ids, ten times a context of a few hundred thousand tokens,
# and the same context as text even when every character is a JSON escape ("\u6f22",
# 6 bytes) at ~1.5 characters per token. It bounds what one request can make a server
# parse and hold.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20

LIMIT_FLAG = "--max-request-body-bytes"


def declared_over(declared: bytes | None, limit: int | None) -> bool:
    """True when a ``Content-Length`` header says the body is over ``limit``."""
    if limit is None or declared is None:
        return False
    try:  # (the HTTP server has already refused a malformed Content-Length)
        return int(declared) > limit
    except ValueError:
        return False


def too_large_message(limit: int, declared: bytes | None = None) -> str:
    size = f" {declared.decode('latin-1')} bytes," if declared is not None else ""
    return f"request body is{size} over this server's limit of {limit} bytes ({LIMIT_FLAG})"


async def read_limited(receive: Receive, limit: int | None) -> Message | None:
    """The whole body as one ``http.request`` message, or ``None`` once it passes
    ``limit`` (the rest is never read). A disconnect is returned as it is."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return message
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            return None
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}


def replay(first: Message, receive: Receive) -> Receive:
    """A ``receive`` that returns ``first``, then whatever ``receive`` returns."""
    pending: list[Message] = [first]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed


ErrorSender = Callable[[Send, int, str], Awaitable[None]]


class BodyLimitMiddleware:
    """Pure ASGI: 413 for a body over ``max_body_bytes`` (``None``: no limit), read as
    the module docstring says; the app gets the body replayed, and nothing when the
    client went away mid-upload. ``send_error(send, status, message)`` answers."""

    def __init__(
        self, app: ASGIApp, *, max_body_bytes: int | None, send_error: ErrorSender
    ) -> None:
        if max_body_bytes is not None and max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1 or None, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.send_error = send_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared_over(declared, limit):
            assert limit is not None
            await self.send_error(send, 413, too_large_message(limit, declared))
            return
        body = await read_limited(receive, limit)
        if body is None:
            assert limit is not None
            await self.send_error(send, 413, too_large_message(limit))
            return
        if body["type"] == "http.disconnect":  # gone mid-upload: nobody to answer
            return
        await self.app(scope, replay(body, receive), send)
