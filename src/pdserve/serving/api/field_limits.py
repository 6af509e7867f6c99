"""Bounds on the request fields whose cost grows with their size, checked before the
body is parsed into the request model.

Parsing and validating a request runs on the event loop, and some fields cost work
per entry there and later (``bad_words`` are tokenized one by one, ``logit_bias`` and
``allowed_token_ids`` become tensors, stop strings are matched at every token, tools
and chat messages are validated part by part and rendered by the template). Without a
bound a single request with a million entries stalls every other request of the
instance for seconds. So every POST body first goes through :func:`check_field_limits`:
a fast scan (msgspec, skipping everything but the bounded fields, which it takes as raw
JSON) that refuses with 400, naming the field and the limit,

* a bounded field whose raw JSON is over its byte budget (refused from its size alone,
  without parsing its entries), or that has more entries than its count limit
  (:data:`LIMITS`);
* more than :data:`MAX_MESSAGES` chat messages (or Responses ``input`` items), or more
  than :data:`MAX_MESSAGE_PARTS` content parts and tool calls in them all.

A body the scan cannot read (not JSON, not an object, a field of the wrong type) is left
to the request model, which refuses it as before. :class:`LimitedRoute` runs the check
for every route of the app.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pdserve.serving.api.protocol import RequestError

KIB = 1024
# field -> (most entries, most bytes of raw JSON)
LIMITS: dict[str, tuple[int, int]] = {
    "bad_words": (1024, 256 * KIB),
    "logit_bias": (1024, 64 * KIB),
    "allowed_token_ids": (262_144, 4096 * KIB),
    "stop": (1024, 256 * KIB),
    "stop_token_ids": (1024, 64 * KIB),
    "tools": (128, 4096 * KIB),
}
MAX_MESSAGES = 8192  # chat messages, or Responses input items
MAX_MESSAGE_PARTS = 8192  # content parts and tool calls, over all of them

_NULL = msgspec.Raw(b"null")


class _Message(msgspec.Struct):
    content: msgspec.Raw = _NULL
    tool_calls: msgspec.Raw = _NULL


class _Probe(msgspec.Struct):
    bad_words: msgspec.Raw = _NULL
    logit_bias: msgspec.Raw = _NULL
    allowed_token_ids: msgspec.Raw = _NULL
    stop: msgspec.Raw = _NULL
    stop_token_ids: msgspec.Raw = _NULL
    tools: msgspec.Raw = _NULL
    messages: msgspec.Raw = _NULL
    input: msgspec.Raw = _NULL


class _ChatProbe(_Probe):
    """The usual chat body in one pass: messages that are objects."""

    messages: list[_Message] | None = None  # type: ignore[assignment]


_probe = msgspec.json.Decoder(_Probe)
_chat_probe = msgspec.json.Decoder(_ChatProbe)
_message = msgspec.json.Decoder(_Message)
_items = msgspec.json.Decoder(list[msgspec.Raw])
_keys = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def _first(raw: msgspec.Raw) -> bytes:
    """The first non-blank byte of a raw JSON value (b"" for none)."""
    view = memoryview(raw)
    for i in range(min(len(view), 64)):
        if view[i] not in b" \t\r\n":
            return bytes(view[i : i + 1])
    return b""


def _entries(raw: msgspec.Raw) -> int:
    """Entries of a JSON array or object (1 for any other value, 0 for null or a value
    that does not decode: the request model judges those)."""
    first = _first(raw)
    try:
        if first == b"[":
            return len(_items.decode(raw))
        if first == b"{":
            return len(_keys.decode(raw))
    except _ERRORS:
        return 0
    return 0 if first in (b"", b"n") else 1


def _size(n: int) -> str:
    return f"{n / KIB / KIB:.1f} MiB" if n >= KIB * KIB else f"{n / KIB:.0f} KiB"


def check_field_limits(body: bytes) -> None:
    """:class:`RequestError` (400) naming the first field over its limit; see the module
    docstring."""
    probe: _Probe
    try:
        probe = _chat_probe.decode(body)
    except _ERRORS:
        try:
            probe = _probe.decode(body)
        except _ERRORS:
            return  # not a JSON object as expected: the request model says what is wrong
    for name, (most, budget) in LIMITS.items():
        raw = getattr(probe, name)
        if len(raw) > budget:
            raise RequestError(
                f"{name} is {_size(len(raw))} of JSON, over this server's limit of {_size(budget)}",
                name,
            )
        n = _entries(raw)
        if n > most:
            raise RequestError(f"{name} has {n} entries, over this server's limit of {most}", name)
    messages = probe.messages
    _check_messages("messages", messages if isinstance(messages, list) else _decoded(messages))
    _check_messages("input", _decoded(probe.input))


def _decoded(raw: msgspec.Raw | None) -> list[_Message]:
    """The items of a raw JSON array as messages (items that are no object: empty)."""
    if raw is None or _first(raw) != b"[":
        return []
    try:
        items = _items.decode(raw)
    except _ERRORS:
        return []
    out = []
    for item in items:
        try:
            out.append(_message.decode(item))
        except _ERRORS:
            out.append(_Message())
    return out


def _check_messages(name: str, items: list[_Message]) -> None:
    if len(items) > MAX_MESSAGES:
        raise RequestError(
            f"{name} has {len(items)} entries, over this server's limit of {MAX_MESSAGES}",
            name,
        )
    parts = 0
    for msg in items:
        parts += _entries(msg.content) if _first(msg.content) == b"[" else 0
        parts += _entries(msg.tool_calls)
        if parts > MAX_MESSAGE_PARTS:
            raise RequestError(
                f"{name} hold more than {MAX_MESSAGE_PARTS} content parts and tool calls, "
                "this server's limit",
                name,
            )


class LimitedRoute(APIRoute):
    """An ``APIRoute`` whose handler first runs :func:`check_field_limits` on the body
    (the body is read once; the route's own parsing reuses it)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def limited(request: Request) -> Response:
            if request.method == "POST":
                try:
                    body = await request.body()
                except ClientDisconnect:  # gone mid-upload: nobody to answer
                    return Response(status_code=499)
                check_field_limits(body)
            return await handler(request)

        return limited
