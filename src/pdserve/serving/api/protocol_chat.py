"""Chat-specific models: function tools and tool calls in requests, and the chat answer
(message, stream delta, chunk) with ``reasoning_content`` and ``tool_calls``.

Tools: only ``{"type": "function", "function": {...}}``; ``strict: true`` is refused
(it needs constrained decoding). An assistant message's ``tool_calls`` carry
``arguments`` as a JSON text (OpenAI) or an object; templates receive them as an
object (:func:`template_tool_calls`), which is what tool-aware chat templates iterate.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pdserve.serving.api.protocol_base import RequestError, ResponseModel, StrictModel, UsageInfo

STRUCTURED_OUTPUT_NEEDED = (
    "needs structured output (constrained decoding), which pdserve does not implement yet"
)


# ---------------------------------------------------------------- tools in requests


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _not_strict(self) -> FunctionDefinition:
        if self.strict:
            raise RequestError(
                f"tool {self.name!r}: strict=true {STRUCTURED_OUTPUT_NEEDED}; leave it unset",
                "tools",
            )
        return self


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
    """The effective choice, ``"none"`` or ``"auto"``; refuses the rest (400)."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        raise RequestError(f"a named tool_choice {STRUCTURED_OUTPUT_NEEDED}", "tool_choice")
    if choice == "required":
        raise RequestError(f"tool_choice='required' {STRUCTURED_OUTPUT_NEEDED}", "tool_choice")
    if choice == "auto" and not tools:
        raise RequestError("tool_choice='auto' needs tools", "tool_choice")
    return choice


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

    def to_json(self) -> str:
        """JSON of the chunk, with ``None`` fields of each delta left out (OpenAI's shape)."""
        data = self.model_dump(mode="json")
        for choice, raw in zip(self.choices, data["choices"], strict=True):
            raw["delta"] = choice.delta.to_json_dict()
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False)
