"""Chat-specific models: function tools and tool calls in requests, and the chat answer
(message, stream delta, chunk) with ``reasoning_content`` and ``tool_calls``.

Tools: only ``{"type": "function", "function": {...}}``. ``tool_choice`` ``"required"``
or a named function constrains the output to tool calls (structured output over the
schema of :func:`forced_tool_schema`); ``strict: true`` is accepted only then (with
``"auto"`` the calls are parsed from free text, which nothing would enforce). An assistant message's ``tool_calls`` carry
``arguments`` as a JSON text (OpenAI) or an object; templates receive them as an
object (:func:`template_tool_calls`), which is what tool-aware chat templates iterate.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import Field, field_validator

from pdserve.serving.api.protocol_base import (
    PromptLogprobs,
    RequestError,
    ResponseModel,
    StrictModel,
    UsageInfo,
)

# ---------------------------------------------------------------- tools in requests


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(StrictModel):
    type: str
    function: FunctionDefinition

    @field_validator("type")
    @classmethod
    def _function_only(cls, v: str) -> str:
        if v != "function":
            raise RequestError(f"tool type {v!r} is not supported (only 'function')", "tools")
        return v


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tool_choice(tools: list[ChatTool] | None, choice: ToolChoice | None) -> str:
    """The effective choice: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``."""
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools or []]
        if choice.function.name not in names:
            raise RequestError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools "
                f"({', '.join(names) or 'none given'})",
                "tool_choice",
            )
        return "named"
    if choice in ("auto", "required") and not tools:
        raise RequestError(f"tool_choice={choice!r} needs tools", "tool_choice")
    if choice != "required":
        strict = [t.function.name for t in tools or [] if t.function.strict]
        if strict:
            raise RequestError(
                f"tool {strict[0]!r}: strict=true is enforced only with tool_choice "
                "'required' or a named function; leave it unset",
                "tools",
            )
    return choice


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def forced_tool_schema(
    tools: list[ChatTool] | None, choice: ToolChoice | None, parallel: bool | None
) -> str | None:
    """The JSON schema the output must follow for ``tool_choice`` required / named, as
    vLLM constrains it: a named function's output is its arguments object; a required
    one's is an array of ``{"name", "parameters"}`` calls (one item at most with
    ``parallel_tool_calls=false``). None for the other choices."""
    kind = check_tool_choice(tools, choice)
    if kind == "named":
        assert isinstance(choice, NamedToolChoice) and tools
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return json.dumps(_parameters(tool))
    if kind != "required":
        return None
    assert tools
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if parallel is False:
        schema["maxItems"] = 1
    return json.dumps(schema)


class ToolCallFunctionParam(StrictModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallParam(StrictModel):
    """A tool call of an earlier assistant message, as the client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    index: int | None = None
    function: ToolCallFunctionParam


def template_tool_calls(calls: list[ToolCallParam], where: str) -> list[dict[str, Any]]:
    """The calls as chat templates expect them: ``arguments`` as an object."""
    out = []
    for i, call in enumerate(calls):
        args: Any = call.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise RequestError(
                    "tool call arguments must be a JSON object", f"{where}.tool_calls.{i}"
                )
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": call.function.name, "arguments": args},
        }
        if call.id is not None:
            entry["id"] = call.id
        out.append(entry)
    return out


# ---------------------------------------------------------------- the answer


class FunctionCall(ResponseModel):
    name: str
    arguments: str


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(ResponseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaMessage(ResponseModel):
    """A streamed delta; ``None`` fields are left out of the JSON."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)

    def is_empty(self) -> bool:
        return not (self.content or self.reasoning_content or self.tool_calls)


class ChatLogProb(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatCompletionResponseChoice(ResponseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension


class ChatCompletionStreamChoice(ResponseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # on the stream's first chunk only

    def to_json(self) -> str:
        """JSON of the chunk, with ``None`` fields of each delta left out (OpenAI's shape)."""
        data = self.model_dump(mode="json")
        if data["prompt_logprobs"] is None:
            del data["prompt_logprobs"]
        for choice, raw in zip(self.choices, data["choices"], strict=True):
            raw["delta"] = choice.delta.to_json_dict()
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False)
