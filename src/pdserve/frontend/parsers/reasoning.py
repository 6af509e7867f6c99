"""Reasoning parsers: split ``<think>`` … ``</think>`` output into reasoning and content.

Two styles (``--reasoning-parser``):

* ``deepseek_r1``: the chat template opens ``<think>`` itself, so the output starts
  inside the reasoning; everything up to ``</think>`` is reasoning (a leading
  ``<think>`` the model writes anyway is dropped). Output that never closes the
  reasoning is all reasoning.
* ``glm45``: the output is reasoning only when it opens with ``<think>`` (after
  optional whitespace), or when the rendered prompt already ends with an open
  ``<think>`` (templates that open it for the model); otherwise it is all content.

Thinking is off (everything is content, nothing is parsed) when the request's
``chat_template_kwargs`` say so: ``enable_thinking: false`` (GLM, Qwen) or
``thinking: false`` (DeepSeek-V3.1), or when the rendered prompt ends with a closed
``<think></think>`` pair (the template's way of switching thinking off).

The parser is a small state machine (before / in reasoning / in content); in the
reasoning state it holds back the longest tail of the text that is a prefix of
``</think>``, so an end tag split across chunks is found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

START = "<think>"
END = "</think>"
REASONING_PARSERS = ("deepseek_r1", "glm45")

_BEFORE, _REASONING, _CONTENT = range(3)
_CLOSED_AT_END = re.compile(r"<think>\s*</think>\s*$")
_OPEN_AT_END = re.compile(r"<think>\s*$")


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def thinking_disabled(template_kwargs: dict[str, Any] | None) -> bool:
    """Whether ``chat_template_kwargs`` switch thinking off."""
    kw = template_kwargs or {}
    return kw.get("enable_thinking") is False or kw.get("thinking") is False


@dataclass
class ReasoningSplit:
    """What one piece of output text adds to each side."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ReasoningParser:
    """The split of one request's output (feed pieces with :meth:`feed`, then
    :meth:`finish`). ``prompt`` is the rendered prompt, when there is one."""

    def __init__(self, style: str, *, prompt: str | None = None, enabled: bool = True) -> None:
        if style not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {style!r}; choose from {REASONING_PARSERS}")
        self.style = style
        tail = (prompt or "")[-64:]
        closed = bool(_CLOSED_AT_END.search(tail))
        opened = not closed and bool(_OPEN_AT_END.search(tail))
        if not enabled or closed:
            self._state = _CONTENT
            self._default = _CONTENT
        else:
            self._state = _BEFORE
            self._default = _REASONING if (style == "deepseek_r1" or opened) else _CONTENT
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state == _REASONING

    def feed(self, text: str) -> ReasoningSplit:
        out = ReasoningSplit()
        buf = self._held + text
        self._held = ""
        while buf:
            if self._state == _BEFORE:
                stripped = buf.lstrip()
                if stripped.startswith(START):
                    self._state = _REASONING
                    buf = stripped[len(START) :]
                elif START.startswith(stripped):  # whitespace or a partial start tag
                    self._held = buf
                    return out
                else:
                    self._state = self._default
            elif self._state == _REASONING:
                i = buf.find(END)
                if i >= 0:
                    out.reasoning += buf[:i]
                    self._state = _CONTENT
                    buf = buf[i + len(END) :]
                    continue
                keep = partial_suffix(buf, END)
                out.reasoning += buf[: len(buf) - keep]
                self._held = buf[len(buf) - keep :]
                return out
            else:
                out.content += buf
                return out
        return out

    def finish(self) -> ReasoningSplit:
        """What is still held back, given to the side it belongs to."""
        held, self._held = self._held, ""
        if not held:
            return ReasoningSplit()
        if self._state == _REASONING:
            return ReasoningSplit(reasoning=held)
        if self._state == _BEFORE and self._default == _REASONING:
            return ReasoningSplit(reasoning=held if held.strip() else "")
        return ReasoningSplit(content=held)

    def parse_whole(self, text: str) -> ReasoningSplit:
        """The split of a whole output."""
        a = self.feed(text)
        b = self.finish()
        return ReasoningSplit(a.reasoning + b.reasoning, a.content + b.content)
