"""HTTP pieces shared by pdserve's servers (the API server and the P/D proxy): the
OpenAI error body, request-id rules, client-disconnect detection and SSE framing.

Every error either server returns has the shape
``{"error": {"message": str, "type": str, "param": str | None, "code": int}}``; the
``type`` follows the status (:data:`ERROR_TYPES`; any other 4xx is ``BadRequestError``,
any other 5xx ``ServerError``). An error that happens after a stream's status line
was sent is the same body in an SSE event (:func:`sse_error`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Receive, Send

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape used by every pdserve server."""
    err_type = ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "ServerError")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_json(status: int, message: str, param: str | None = None) -> bytes:
    """:func:`error_body` as JSON bytes (for raw ASGI sends and proxied replies)."""
    return json.dumps(error_body(status, message, param)).encode()


async def send_error_json(
    send: Send,
    status: int,
    message: str,
    param: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """An error response sent straight on an ASGI ``send`` (from a middleware)."""
    body = error_json(status, message, param)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


# -- request ids ----------------------------------------------------------------------

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_LEN = 256


def valid_request_id(value: str) -> bool:
    """An ``X-Request-Id`` both servers accept: 1-256 visible ASCII characters."""
    return 0 < len(value) <= MAX_REQUEST_ID_LEN and all(33 <= ord(c) <= 126 for c in value)


# -- client disconnect ----------------------------------------------------------------


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI ``receive`` channel reports ``http.disconnect``. Only use it
    after the request body has been read: from then on ``receive`` reports nothing else."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


# -- server-sent events ---------------------------------------------------------------

SSE_DONE = "data: [DONE]\n\n"


def sse_event(data: str) -> str:
    """One SSE ``data:`` event."""
    return f"data: {data}\n\n"


def sse_error(status: int, message: str, param: str | None = None) -> str:
    """An in-stream error event (the status line has already been sent)."""
    return sse_event(json.dumps(error_body(status, message, param)))
