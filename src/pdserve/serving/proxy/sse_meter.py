"""A read-only observer of an OpenAI SSE stream, for the proxy's TTFT/TPOT metrics.

The proxy passes the upstream bytes to the client untouched, chunk by chunk; it also
feeds each chunk to a :class:`SSEMeter`, which splits events on blank lines (``\\n\\n``
or ``\\r\\n\\r\\n``; carriage returns are dropped from its private copy) and records the
arrival time of every ``data:`` event that carries tokens: its JSON has a non-empty
``choices`` list (completions, chat) or is a Responses API text delta (``type``
``response.output_text.delta`` or ``response.reasoning_text.delta``).
``data: [DONE]`` sets :attr:`SSEMeter.done`. Malformed events are ignored: metering
must never disturb the stream.
"""

from __future__ import annotations

import json

# A stream that never ends an event would grow the buffer without bound; past this
# many bytes the partial event is dropped (it is only used for metrics).
_MAX_PENDING = 1 << 20
# Responses API stream events that carry generated text
_DELTA_TYPES = ("response.output_text.delta", "response.reasoning_text.delta")


class SSEMeter:
    """Counts token-carrying events and remembers the first and last arrival times."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.count = 0
        self.first: float | None = None
        self.last: float | None = None
        self.done = False

    @property
    def at_event_boundary(self) -> bool:
        """True if every byte fed so far belongs to a complete event."""
        return not self._buf.strip()

    def feed(self, chunk: bytes, now: float) -> None:
        """Account for ``chunk`` (raw upstream bytes) received at ``now``."""
        self._buf += chunk.replace(b"\r", b"")
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                break
            event = bytes(self._buf[:end])
            del self._buf[: end + 2]
            self._on_event(event, now)
        if len(self._buf) > _MAX_PENDING:
            self._buf.clear()

    def tpot(self) -> float | None:
        """Mean gap between token events, or ``None`` with fewer than two of them."""
        if self.count < 2 or self.first is None or self.last is None:
            return None
        return (self.last - self.first) / (self.count - 1)

    def _on_event(self, event: bytes, now: float) -> None:
        data_lines = [
            line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        ]
        if not data_lines:
            return
        data = b"\n".join(data_lines).strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        choices = obj.get("choices")
        if (isinstance(choices, list) and choices) or obj.get("type") in _DELTA_TYPES:
            self.count += 1
            if self.first is None:
                self.first = now
            self.last = now
