"""SSE decoding: events split anywhere, comments, line endings, UTF-8."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.bench.sse import SSEDecoder

STREAM = (
    b": ping\n\n"
    b'data: {"choices":[{"text":"h\xc3\xa9llo \xf0\x9f\x98\x80"}]}\n\n'
    b"event: message\r\nid: 7\r\n"
    b'data: {"choices":[]}\r\n\r\n'
    b"data: line1\ndata:line2\n\n"
    b":another comment\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    '{"choices":[{"text":"héllo 😀"}]}',
    '{"choices":[]}',
    "line1\nline2",
    "[DONE]",
]


def _decode(parts: list[bytes]) -> list[str]:
    dec = SSEDecoder()
    events: list[str] = []
    for p in parts:
        events.extend(dec.feed(p))
    return events + dec.flush()


def test_whole_stream() -> None:
    assert _decode([STREAM]) == EXPECTED


def test_byte_by_byte() -> None:
    assert _decode([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_split(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    parts = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    assert _decode(parts) == EXPECTED


def test_event_completes_only_at_blank_line() -> None:
    dec = SSEDecoder()
    assert dec.feed(b'data: {"a": 1}\n') == []
    assert dec.feed(b"\n") == ['{"a": 1}']


def test_cr_split_from_lf() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: x\r") == []
    assert dec.feed(b"\n\r") == []
    assert dec.feed(b"\n") == ["x"]


def test_flush_emits_unterminated_event() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: [DONE]") == []
    assert dec.flush() == ["[DONE]"]
