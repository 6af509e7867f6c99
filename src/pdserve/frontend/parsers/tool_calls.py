"""Tool-call parsers: find the calls a model writes in its output text.

Formats (``--tool-call-parser``), each written from its published description:

* ``glm45``: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>…</tool_call>``;
* ``glm47``: the same with no newline after the name and no whitespace between the
  tags (both parsers accept both spacings);
* ``deepseek_v31``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}
  <｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`` (the outer pair is dropped);
* ``hermes``: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``.

GLM argument values are text; a value is JSON-decoded only when the tool's JSON schema
gives that parameter a non-string type (number, integer, boolean, object, array, null)
and the text decodes. Arguments are returned as a JSON object text.

Streaming (:class:`ToolCallParser`): text outside calls is content and flows out at
once, except a tail that could still be the start of a marker; a call is buffered from
its opening marker to its closing one and then parsed. A call that does not parse
(unknown shape, bad JSON, no name) or is never closed goes out as plain content,
markers included, so a malformed call never fails the request. Whitespace between and
after calls is dropped.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.frontend.parsers.reasoning import partial_suffix

Schemas = dict[str, dict[str, Any]]  # tool name -> its "parameters" JSON schema


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


@dataclass
class ToolEvents:
    """What one piece of text adds: content for the user and calls completed by it."""

    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)

    def extend(self, other: ToolEvents) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


# ------------------------------------------------------------------------ formats


_NAME = re.compile(r"\s*([^\s<>]+)\s*")
_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)
_NON_STRING_TYPES = frozenset({"number", "integer", "boolean", "object", "array", "null"})


def _wants_json(schema: dict[str, Any] | None, key: str) -> bool:
    props = (schema or {}).get("properties")
    prop = props.get(key) if isinstance(props, dict) else None
    typ = prop.get("type") if isinstance(prop, dict) else None
    if isinstance(typ, str):
        return typ in _NON_STRING_TYPES
    if isinstance(typ, list):
        return "string" not in typ and any(t in _NON_STRING_TYPES for t in typ)
    return False


def typed_value(schema: dict[str, Any] | None, key: str, raw: str) -> Any:
    """A GLM argument value: text, or decoded JSON where the schema asks for it."""
    if _wants_json(schema, key):
        try:
            return json.loads(raw.strip())
        except ValueError:
            return raw
    return raw


def parse_glm(body: str, schemas: Schemas) -> tuple[str, str] | None:
    m = _NAME.match(body)
    if m is None:
        return None
    name = m.group(1)
    pos = m.end()
    args: dict[str, Any] = {}
    schema = schemas.get(name)
    while pos < len(body):
        pair = _GLM_PAIR.match(body, pos)
        if pair is None:
            return None
        key = pair.group(1).strip()
        if not key:
            return None
        args[key] = typed_value(schema, key, pair.group(2))
        pos = pair.end()
    return name, json.dumps(args, ensure_ascii=False)


def parse_hermes(body: str, schemas: Schemas) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


DS_SEP = "<｜tool▁sep｜>"


def parse_deepseek_v31(body: str, schemas: Schemas) -> tuple[str, str] | None:
    name, sep, raw = body.partition(DS_SEP)
    name = name.strip()
    if not sep or not name or any(c.isspace() for c in name):
        return None
    try:
        args = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


@dataclass(frozen=True)
class ToolFormat:
    open: str
    close: str
    parse: Callable[[str, Schemas], tuple[str, str] | None]
    dropped: tuple[str, ...] = ()  # wrapper markers removed from the text outside calls


_GLM = ToolFormat("<tool_call>", "</tool_call>", parse_glm)
TOOL_FORMATS: dict[str, ToolFormat] = {
    "glm45": _GLM,
    "glm47": _GLM,
    "deepseek_v31": ToolFormat(
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        parse_deepseek_v31,
        dropped=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    ),
    "hermes": ToolFormat("<tool_call>", "</tool_call>", parse_hermes),
}
TOOL_CALL_PARSERS = tuple(TOOL_FORMATS)


def tool_schemas(tools: list[dict[str, Any]] | None) -> Schemas:
    """``{name: parameters schema}`` of OpenAI function tools (plain dicts)."""
    out: Schemas = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


# ------------------------------------------------------------------------ streaming


class ToolCallParser:
    """The calls and content of one request's output; see the module docstring."""

    def __init__(self, fmt: ToolFormat, schemas: Schemas) -> None:
        self.fmt = fmt
        self.schemas = schemas
        self._markers = (fmt.open, *fmt.dropped)
        self._inside = False
        self._held = ""  # outside: a possible marker start; inside: the call so far
        self._pending_ws = ""  # whitespace after a call, dropped unless content follows
        self.num_calls = 0

    def _content(self, out: ToolEvents, text: str) -> None:
        if not text:
            return
        if self.num_calls and not text.strip():
            self._pending_ws += text
            return
        out.content += self._pending_ws + text
        self._pending_ws = ""

    def feed(self, text: str) -> ToolEvents:
        out = ToolEvents()
        buf = self._held + text
        self._held = ""
        while buf:
            if self._inside:
                j = buf.find(self.fmt.close)
                if j < 0:
                    self._held = buf
                    return out
                self._inside = False
                self._close_call(out, buf[:j])
                buf = buf[j + len(self.fmt.close) :]
                continue
            hits = [(i, m) for m in self._markers if (i := buf.find(m)) >= 0]
            if not hits:
                keep = max(partial_suffix(buf, m) for m in self._markers)
                self._content(out, buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                return out
            i, marker = min(hits)
            self._content(out, buf[:i])
            buf = buf[i + len(marker) :]
            self._inside = marker == self.fmt.open
        return out

    def _close_call(self, out: ToolEvents, body: str) -> None:
        parsed = self.fmt.parse(body, self.schemas)
        if parsed is None:  # malformed: the user sees the text as written
            self._content(out, self.fmt.open + body + self.fmt.close)
            return
        self.num_calls += 1
        self._pending_ws = ""
        out.calls.append(ParsedToolCall(name=parsed[0], arguments=parsed[1]))

    def finish(self) -> ToolEvents:
        """The end of the output: an unclosed call or a held tail becomes content."""
        out = ToolEvents()
        held, self._held = self._held, ""
        if self._inside:
            self._inside = False
            self._content(out, self.fmt.open + held)
        else:
            self._content(out, held)
        self._pending_ws = ""
        return out

    def parse_whole(self, text: str) -> ToolEvents:
        out = self.feed(text)
        out.extend(self.finish())
        return out


def make_tool_call_parser(name: str, tools: list[dict[str, Any]] | None) -> ToolCallParser:
    fmt = TOOL_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {TOOL_CALL_PARSERS}")
    return ToolCallParser(fmt, tool_schemas(tools))
