"""Lone surrogates in request strings.

JSON may spell a UTF-16 surrogate on its own (``"\\ud800"``); Python's ``json`` decodes it
into a ``str`` that cannot be encoded as UTF-8, so the tokenizer, the response encoder
or any log line that touches it fails. The request models refuse such a string anywhere
in a body (values and keys) before any other check, with a 400 naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset({int, float, bool, type(None)})


def _surrogate_at(s: str) -> tuple[int, str] | None:
    if s.isascii():
        return None
    m = _SURROGATE.search(s)
    return None if m is None else (m.start(), f"U+{ord(m.group()):04X}")


def _children(obj: dict[Any, Any] | list[Any]) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        return ((str(k), v) for k, v in obj.items())
    if set(map(type, obj)) <= _SCALARS:  # token ids and the like: nothing to look at
        return iter(())
    return ((str(i), v) for i, v in enumerate(obj))


def find_lone_surrogate(value: Any) -> tuple[str | None, int, str] | None:
    """``(field path, character index, code point)`` of the first lone surrogate in a
    decoded JSON value (path like ``"messages.0.content"``; ``None`` for the top level),
    or ``None``. A surrogate in a key is reported at the key's path."""
    if isinstance(value, str):
        hit = _surrogate_at(value)
        return None if hit is None else (None, *hit)
    if not isinstance(value, dict | list):
        return None
    stack: list[tuple[Iterator[tuple[str, Any]], tuple[str, ...]]] = [(_children(value), ())]
    while stack:
        children, path = stack[-1]
        for key, item in children:
            here = (*path, key)
            hit = _surrogate_at(key)
            if hit is None and isinstance(item, str):
                hit = _surrogate_at(item)
            if hit is not None:
                return ".".join(here).encode("utf-8", "backslashreplace").decode(), *hit
            if isinstance(item, dict | list):
                stack.append((_children(item), here))
                break
        else:
            stack.pop()
    return None


def lone_surrogate_message(param: str | None, index: int, code_point: str) -> str:
    where = f"{param}: " if param else ""
    return (
        f"{where}invalid Unicode: a lone surrogate ({code_point}) at character {index}; "
        "strings must be valid UTF-8 text (a surrogate is valid only as half of a pair)"
    )
