"""The API app's errors and exception handlers.

Every error the server returns has the shape
``{"error": {"message": str, "type": str, "param": str | None, "code": int}}``
(:func:`pdserve.serving.http.error_body`, shared with the proxy). Mapping: request
validation (pydantic, :class:`RequestError`, engine ``ValueError``) → 400 — never
FastAPI's default 422; unknown routes keep their 404/405; anything unexpected → 500
with a generic message (the traceback goes to the log only).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.serving.api.protocol import RequestError
from pdserve.serving.http import error_response

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with an HTTP status, raised by handlers and rendered as an OpenAI body."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _loc_param(loc: Sequence[Any]) -> str | None:
    """``messages.0.content`` from a pydantic location, without union-member tags."""
    parts = [
        str(p)
        for p in loc
        if p != "body" and not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p))
    ]
    return ".".join(parts) if parts else None


def _cause(error: Any) -> RequestError | None:
    ctx = error.get("ctx") if isinstance(error, dict) else None
    cause = ctx.get("error") if isinstance(ctx, dict) else None
    return cause if isinstance(cause, RequestError) else None


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """``(message, param)`` for a list of pydantic/FastAPI error dicts: the most telling
    error in full (one of ours, with its own message, if any), a count of the rest."""
    if not errors:
        return "invalid request", None
    first = next((e for e in errors if _cause(e) is not None), errors[0])
    loc = first.get("loc", ()) if isinstance(first, dict) else ()
    param = _loc_param(loc)
    etype = first.get("type") if isinstance(first, dict) else None
    cause = _cause(first)
    if cause is not None:
        message = cause.message
        param = cause.param or param
    elif etype == "extra_forbidden":
        message = f"unsupported field {param!r}: pdserve does not implement it"
    elif etype == "missing":
        message = f"field {param!r} is required"
    elif etype == "json_invalid":
        message = "request body is not valid JSON"
        param = None
    else:
        msg = str(first.get("msg", "invalid value")) if isinstance(first, dict) else str(first)
        msg = msg.removeprefix("Value error, ")
        message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more validation error(s))"
    return message, param


def install_exception_handlers(app: FastAPI) -> None:
    """Route every failure through :func:`error_response`."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, exc.message, exc.param)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        # engine.generate raises ValueError for prompts/params it rejects
        return error_response(400, str(exc) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, "internal server error")
