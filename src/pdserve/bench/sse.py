"""Incremental Server-Sent-Events decoder for OpenAI-style streams.

Feed it raw bytes as they arrive; it returns the ``data`` payload of every event
completed by those bytes. Handles events and UTF-8 characters split across reads,
``\\n``/``\\r\\n``/``\\r`` line endings, ``:`` comment lines (keep-alive pings)
and multi-line ``data`` fields (joined with ``\\n``, per the SSE spec). Other
fields (``event``, ``id``, ``retry``) are ignored. ``flush`` at end of stream
also emits a final event that lacked its terminating blank line.
"""

from __future__ import annotations

import codecs


class SSEDecoder:
    """Stateful decoder; one instance per response body."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Consume bytes; return payloads of events completed so far, in order."""
        self._buf += self._utf8.decode(chunk)
        return self._drain(final=False)

    def flush(self) -> list[str]:
        """End of stream: return any event still pending (tolerates a missing blank line)."""
        self._buf += self._utf8.decode(b"", final=True)
        events = self._drain(final=True)
        if self._buf:
            self._line(self._buf, events)
            self._buf = ""
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _drain(self, final: bool) -> list[str]:
        events: list[str] = []
        buf = self._buf
        pos = 0
        n = len(buf)
        while pos < n:
            nl = buf.find("\n", pos)
            cr = buf.find("\r", pos)
            if nl < 0 and cr < 0:
                break
            if cr >= 0 and (nl < 0 or cr < nl):
                # "\r" ends a line; a "\r" at the buffer end might be half of "\r\n".
                if cr == n - 1 and not final:
                    break
                end, nxt = cr, cr + (2 if cr + 1 < n and buf[cr + 1] == "\n" else 1)
            else:
                end, nxt = nl, nl + 1
            self._line(buf[pos:end], events)
            pos = nxt
        self._buf = buf[pos:]
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        field, sep, value = line.partition(":")
        if not sep:
            field, value = line, ""
        elif value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
