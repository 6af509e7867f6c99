"""Connection limits of pdserve's HTTP servers: header and body read timeouts and a cap
on idle connections, on top of uvicorn's h11 protocol (the only one pdserve runs).

Stock uvicorn closes a keep-alive connection that stays idle after a response, and
nothing else: a client that sends its headers one byte at a time, or its body at one
byte per second, or that opens connections and never sends a byte, holds them for as
long as it likes. :func:`protocol_class` returns uvicorn's ``H11Protocol`` with three
timers per connection (:class:`ConnectionLimits`):

* **idle**: a new connection that sends nothing is closed after the keep-alive timeout
  (uvicorn's ``timeout_keep_alive``), like an idle connection after a response;
* **headers** (``header_timeout``, default 15 s): from the first byte of a request, its
  headers must be complete within this time; else the server answers ``408 Request
  Timeout`` and closes the connection (slowloris);
* **body** (``body_timeout``, default 60 s): once the headers are in, the whole body
  must arrive within this time; else 408 (if no answer was started) and close.

and one cap per server: at most ``max_idle_connections`` (default 1000) connections
may wait idle (between requests, or before their first byte); past that the one idle
longest is closed. Connections with a request in flight are never closed by the cap.

Each timer is one ``loop.call_later`` handle per connection, armed and cancelled as the
connection's h11 state changes (:meth:`_LimitedH11._update`): no polling.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 15.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_MAX_IDLE_CONNECTIONS = 1000

_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


@dataclass(frozen=True)
class ConnectionLimits:
    """See the module docstring (seconds, and a count)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    max_idle_connections: int = DEFAULT_MAX_IDLE_CONNECTIONS

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout"):
            value = getattr(self, name)
            if not value > 0:  # also refuses NaN
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {value}")
        if self.max_idle_connections < 1:
            raise ValueError(
                f"--max-idle-connections must be >= 1, got {self.max_idle_connections}"
            )


class _IdleConnections:
    """The idle connections of one server, longest idle first (event loop only)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._conns: OrderedDict[_LimitedH11, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._conns)

    def add(self, conn: _LimitedH11) -> None:
        if conn in self._conns:
            return
        self._conns[conn] = None
        while len(self._conns) > self.most:
            oldest, _ = self._conns.popitem(last=False)
            oldest.close_idle()

    def discard(self, conn: _LimitedH11) -> None:
        self._conns.pop(conn, None)


class _LimitedH11(H11Protocol):
    """uvicorn's h11 protocol with the timers of the module docstring; a subclass per
    server binds :attr:`limits` and :attr:`idle` (:func:`protocol_class`)."""

    limits: ClassVar[ConnectionLimits]
    idle: ClassVar[_IdleConnections]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # a connection that never sends a byte is idle like a kept-alive one
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
        self._update()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header()
        self._stop_body()
        self.idle.discard(self)
        super().connection_lost(exc)

    def close_idle(self) -> None:
        """Close this idle connection (the server holds too many)."""
        logger.debug("closing an idle connection from %s (max_idle_connections)", self.client)
        self.timeout_keep_alive_handler()

    # -- the timers ------------------------------------------------------------------------
    def _update(self) -> None:
        """Arm or cancel the timers for the connection's state now."""
        if self.transport is None or self.transport.is_closing():
            self._stop_header()
            self._stop_body()
            self.idle.discard(self)
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # between requests (or before the first)
            self._stop_body()
            if self.conn.trailing_data[0]:  # a request's first bytes are in
                self.idle.discard(self)
                if self._header_timer is None:
                    self._header_timer = self.loop.call_later(
                        self.limits.header_timeout, self._timed_out, "headers"
                    )
                return
            self._stop_header()
            if self.cycle is None or self.cycle.response_complete:
                self.idle.add(self)
            else:
                self.idle.discard(self)
            return
        self._stop_header()
        self.idle.discard(self)
        if state is h11.SEND_BODY:
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(
                    self.limits.body_timeout, self._timed_out, "body"
                )
        else:
            self._stop_body()

    def _stop_header(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _stop_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _timed_out(self, what: str) -> None:
        self._header_timer = self._body_timer = None
        if self.transport.is_closing():
            return
        limit = self.limits.header_timeout if what == "headers" else self.limits.body_timeout
        logger.info(
            "closing a connection from %s: its request %s did not arrive within %gs",
            self.client,
            what,
            limit,
        )
        if self.cycle is None or not self.cycle.response_started or what == "headers":
            msg = f"request {what} not received within {limit:g}s\n".encode()
            self.transport.write(_TIMEOUT_408 % (len(msg), msg))
        self.transport.close()


def protocol_class(limits: ConnectionLimits) -> type[H11Protocol]:
    """An h11 protocol class for one server (``uvicorn.Config(http=...)``) that enforces
    ``limits``; its idle-connection cap is shared by that server's connections only."""
    return type(
        "LimitedH11Protocol",
        (_LimitedH11,),
        {"limits": limits, "idle": _IdleConnections(limits.max_idle_connections)},
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 of seconds, got {text}")
    return value


def positive_count(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``--header-timeout``, ``--body-timeout`` and ``--max-idle-connections``."""
    p.add_argument(
        "--header-timeout",
        type=_positive_seconds,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a request's headers may take from its first byte; then 408 and the "
        f"connection is closed (default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--body-timeout",
        type=_positive_seconds,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request's body may take after its headers; then 408 and the "
        f"connection is closed (default {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--max-idle-connections",
        type=positive_count,
        default=DEFAULT_MAX_IDLE_CONNECTIONS,
        help="idle client connections kept open at most; past that the longest idle is "
        f"closed (default {DEFAULT_MAX_IDLE_CONNECTIONS})",
    )


def from_args(args: argparse.Namespace) -> ConnectionLimits:
    """The limits the flags of :func:`add_cli_args` give (defaults where absent)."""
    return ConnectionLimits(
        header_timeout=getattr(args, "header_timeout", DEFAULT_HEADER_TIMEOUT_S),
        body_timeout=getattr(args, "body_timeout", DEFAULT_BODY_TIMEOUT_S),
        max_idle_connections=getattr(args, "max_idle_connections", DEFAULT_MAX_IDLE_CONNECTIONS),
    )
