"""From output text to the chat answer: reasoning, content and tool calls.

The server's settings (:class:`OutputParsing`: ``--reasoning-parser``,
``--enable-auto-tool-choice``, ``--tool-call-parser``) say which parsers exist; a
request's fields say which of them run on its output (:class:`ChatOutputParser`):

* reasoning is split off when the server has a reasoning parser and the request does
  not switch thinking off (:func:`~pdserve.frontend.parsers.thinking_disabled`);
  ``include_reasoning=false`` drops it from the answer;
* tool calls are parsed when the request has tools and ``tool_choice`` is ``auto`` (the
  default with tools), which needs ``--enable-auto-tool-choice`` and a tool-call
  parser (400 otherwise, as vLLM answers). With ``tool_choice="none"`` the tools still
  reach the template and the output is left as content.

Text goes through the reasoning parser first; only its content side is searched for
tool calls. Streaming: each piece of text becomes at most one reasoning/content delta,
then, for each call it completed, a delta with the call's index, id and function name
(``arguments: ""``) and one with its arguments. The finish reason of a request that made
calls and stopped on its own is ``tool_calls``. With ``parallel_tool_calls=false`` only
the first call is returned (later ones are dropped).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from pdserve.frontend.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ReasoningParser,
    ToolCallParser,
    make_tool_call_parser,
    thinking_disabled,
)
from pdserve.serving.api.protocol import ChatCompletionRequest, RequestError
from pdserve.serving.api.protocol_chat import (
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)

AUTO_TOOLS_NEED_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


@dataclass(frozen=True)
class OutputParsing:
    """The server's parser settings (validated on construction)."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r}; "
                f"choose from {', '.join(REASONING_PARSERS)}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"unknown tool-call parser {self.tool_call_parser!r}; "
                f"choose from {', '.join(TOOL_CALL_PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    @property
    def auto_tools(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    def check_request(self, req: ChatCompletionRequest) -> None:
        """400 for a request that needs parsing this server does not do."""
        if req.effective_tool_choice == "auto" and not self.auto_tools:
            raise RequestError(AUTO_TOOLS_NEED_FLAGS, "tool_choice")

    def for_request(self, req: ChatCompletionRequest, prompt: str | None) -> ChatOutputParser:
        choice = req.effective_tool_choice
        if choice in ("required", "named"):
            named = req.tool_choice.function.name if choice == "named" else None  # type: ignore[union-attr]
            return ForcedToolCalls(named)
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = ReasoningParser(
                self.reasoning_parser,
                prompt=prompt,
                enabled=not thinking_disabled(req.chat_template_kwargs),
            )
        tools = None
        if self.tool_call_parser is not None and req.effective_tool_choice == "auto":
            tools = make_tool_call_parser(self.tool_call_parser, req.tool_dicts())
        return ChatOutputParser(
            reasoning,
            tools,
            include_reasoning=req.include_reasoning,
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )


class ChatOutputParser:
    """The parsers of one request's output (either may be absent)."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolCallParser | None,
        *,
        include_reasoning: bool = True,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.include_reasoning = include_reasoning
        self.parallel_tool_calls = parallel_tool_calls
        self.calls: list[ToolCall] = []

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def feed(self, text: str, *, last: bool = False) -> list[DeltaMessage]:
        """The deltas of one piece of text (``last``: the output ends with it)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if last:
                rest = self.reasoning.finish()
                split.reasoning += rest.reasoning
                split.content += rest.content
            reasoning, content = split.reasoning, split.content
        new_calls: list[ToolCall] = []
        if self.tools is not None:
            events = self.tools.feed(content)
            if last:
                events.extend(self.tools.finish())
            content = events.content
            new_calls = [
                ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in events.calls
            ]
        if not self.include_reasoning:
            reasoning = ""
        deltas = []
        if reasoning or content:
            deltas.append(
                DeltaMessage(reasoning_content=reasoning or None, content=content or None)
            )
        for call in new_calls:
            if self.calls and not self.parallel_tool_calls:
                break  # parallel_tool_calls=false: the first call only
            deltas += _call_deltas(len(self.calls), call)
            self.calls.append(call)
        return deltas

    def whole(self, text: str) -> ChatMessage:
        """The message of a whole output."""
        reasoning: list[str] = []
        content: list[str] = []
        for d in self.feed(text, last=True):
            reasoning.append(d.reasoning_content or "")
            content.append(d.content or "")
        joined = "".join(content)
        return ChatMessage(
            content=joined if joined or not self.calls else None,
            reasoning_content="".join(reasoning) or None,
            tool_calls=list(self.calls),
        )


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ForcedToolCalls(ChatOutputParser):
    """The output of ``tool_choice`` required / named, which structured output made a
    JSON text of the calls (:func:`~pdserve.serving.api.protocol_chat.forced_tool_schema`):
    a named function's arguments object, or an array of ``{"name", "parameters"}``.

    Streaming: a named call sends its id and name with the first text and then the
    arguments as they come; required calls are sent when the output is complete (one
    name delta and one arguments delta per call). The finish reason is ``tool_calls``
    for required calls and ``stop`` for a named one (as OpenAI answers). Required calls
    whose text does not parse as calls (cut by ``max_tokens``) come back as content,
    as vLLM returns them, and a named call cut short keeps its partial arguments."""

    def __init__(self, named: str | None) -> None:
        super().__init__(None, None)
        self.named = named
        self._text: list[str] = []
        self._sent_name = False
        self.content = ""  # required calls' text when it does not parse as calls

    @property
    def active(self) -> bool:
        return True

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.named is None and self.calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    @staticmethod
    def _parse_required(text: str) -> list[ToolCall] | None:
        """The calls of a whole output; None when it is not a complete array of calls
        (cut short by max_tokens, or the client's schema let something else through)."""
        try:
            return [
                ToolCall(
                    id=_call_id(),
                    function=FunctionCall(
                        name=item["name"],
                        arguments=json.dumps(item["parameters"], ensure_ascii=False),
                    ),
                )
                for item in json.loads(text)
            ]
        except (ValueError, TypeError, KeyError):
            return None

    def feed(self, text: str, *, last: bool = False) -> list[DeltaMessage]:
        if self.named is not None:
            deltas = []
            if not self._sent_name:
                self._sent_name = True
                call = ToolCall(id=_call_id(), function=FunctionCall(name=self.named, arguments=""))
                self.calls.append(call)
                name = DeltaFunctionCall(name=self.named, arguments="")
                deltas.append(
                    DeltaMessage(
                        tool_calls=[
                            DeltaToolCall(index=0, id=call.id, type="function", function=name)
                        ]
                    )
                )
            if text:
                self.calls[0].function.arguments += text
                args = DeltaFunctionCall(arguments=text)
                deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=args)]))
            return deltas
        self._text.append(text)
        if not last:
            return []
        whole = "".join(self._text)
        calls = self._parse_required(whole)
        if calls is None:  # not calls: the text reaches the client as content
            self.content = whole
            return [DeltaMessage(content=whole)] if whole else []
        deltas = []
        for index, call in enumerate(calls):
            self.calls.append(call)
            deltas += _call_deltas(index, call)
        return deltas

    def whole(self, text: str) -> ChatMessage:
        self.feed(text, last=True)
        return ChatMessage(content=self.content or None, tool_calls=list(self.calls))


def _call_deltas(index: int, call: ToolCall) -> list[DeltaMessage]:
    """A whole tool call as stream deltas: its id and name, then its arguments."""
    name = DeltaFunctionCall(name=call.function.name, arguments="")
    head = DeltaToolCall(index=index, id=call.id, type="function", function=name)
    args = DeltaFunctionCall(arguments=call.function.arguments)
    return [
        DeltaMessage(tool_calls=[head]),
        DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=args)]),
    ]
