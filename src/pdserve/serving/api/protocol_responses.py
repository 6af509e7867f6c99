"""``POST /v1/responses`` (OpenAI's Responses API): the request model.

Supported: ``input`` as a text or as a list of items: messages (``role`` user, system,
developer or assistant; ``content`` a text or ``input_text`` / ``output_text`` parts),
``function_call`` (an earlier call of the model) and ``function_call_output`` (its
result); ``instructions`` (a system message first), ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``; function ``tools`` (the Responses shape:
``{"type": "function", "name", "description", "parameters", "strict"}``) with
``tool_choice`` ``auto`` / ``none`` / ``required`` / ``{"type": "function", "name"}`` and
``parallel_tool_calls``, served as on ``/v1/chat/completions`` (``auto`` needs
``--enable-auto-tool-choice``; ``required`` and a named function are enforced with
structured output); ``kv_transfer_params`` (the P/D proxy's legs). Bookkeeping fields
(``metadata``, ``user``, ``store``, ``service_tier``) are accepted and ignored (nothing is
stored). Refused with 400: tools of other types (web search, file search, ...),
``previous_response_id`` and ``conversation`` (the server keeps no state),
``background``, ``include``, ``top_logprobs``, a ``text.format`` other than text,
``truncation="auto"``, ``reasoning`` settings, and input items of other types (images,
files).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pdserve.serving.api.protocol import ChatCompletionRequest, ChatMessageParam
from pdserve.serving.api.protocol_base import CheckedModel, RequestError, StrictModel
from pdserve.serving.api.protocol_chat import ToolCallFunctionParam, ToolCallParam

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseInputPart(StrictModel):
    type: str
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v not in _TEXT_PARTS:
            raise RequestError(
                f"input content type {v!r} is not supported; pdserve serves text only", "input"
            )
        return v


class ResponseInputMessage(StrictModel):
    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponseInputPart]
    id: str | None = None
    status: str | None = None

    @field_validator("type")
    @classmethod
    def _message_only(cls, v: str) -> str:
        if v != "message":
            raise RequestError(
                f"input item type {v!r} is not supported on /v1/responses (only messages)",
                "input",
            )
        return v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFunctionCall(StrictModel):
    """An earlier call of the model, sent back in ``input``."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class ResponseFunctionCallOutput(StrictModel):
    """A call's result, sent back in ``input``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ResponseFunctionTool(StrictModel):
    type: str
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, v: str) -> str:
        if v != "function":
            raise RequestError(f"tool type {v!r} is not supported (only 'function')", "tools")
        return v


_InputItem = ResponseInputMessage | ResponseFunctionCall | ResponseFunctionCallOutput
_ITEMS: dict[str, type[StrictModel]] = {
    "message": ResponseInputMessage,
    "function_call": ResponseFunctionCall,
    "function_call_output": ResponseFunctionCallOutput,
}


class ResponsesRequest(CheckedModel):
    model: str | None = None
    input: str | list[_InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # bookkeeping, ignored
    metadata: dict[str, Any] | None = None
    user: str | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, v: Any) -> Any:
        """Each item by its ``type`` (a message when it has none), so an unsupported
        item is one clear 400."""
        if not isinstance(v, list):
            return v
        out = []
        for item in v:
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if not isinstance(kind, str) or kind not in _ITEMS:
                raise RequestError(
                    f"input item type {kind!r} is not supported on /v1/responses (messages, "
                    "function_call and function_call_output)",
                    "input",
                )
            out.append(_ITEMS[kind].model_validate(item))
        return out

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        fmt = (self.text or {}).get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise RequestError("only text.format type 'text' is supported", "text")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise RequestError(
                "reasoning settings are not supported; the model's own reasoning is "
                "returned when the server runs a --reasoning-parser",
                "reasoning",
            )
        if self.truncation == "auto":
            raise RequestError("truncation='auto' is not supported (only 'disabled')", "truncation")
        if self.previous_response_id is not None or self.conversation is not None:
            param = "previous_response_id" if self.previous_response_id else "conversation"
            raise RequestError(
                "pdserve keeps no response state: send the whole conversation in input", param
            )
        if self.background:
            raise RequestError("background responses are not supported", "background")
        if self.include:
            raise RequestError("include is not supported", "include")
        if self.top_logprobs:
            raise RequestError("top_logprobs is not supported on /v1/responses", "top_logprobs")
        if isinstance(self.input, list) and not self.input:
            raise RequestError("input must not be empty", "input")
        return self

    def messages(self) -> list[ChatMessageParam]:
        """The chat messages: consecutive function calls make one assistant message
        with ``tool_calls``, each output a ``tool`` message."""
        out = []
        if self.instructions:
            out.append(ChatMessageParam(role="system", content=self.instructions))
        if isinstance(self.input, str):
            out.append(ChatMessageParam(role="user", content=self.input))
            return out
        for m in self.input:
            if isinstance(m, ResponseInputMessage):
                out.append(ChatMessageParam(role=m.role, content=m.text()))
            elif isinstance(m, ResponseFunctionCallOutput):
                out.append(ChatMessageParam(role="tool", tool_call_id=m.call_id, content=m.output))
            else:
                call = ToolCallParam(
                    id=m.call_id, function=ToolCallFunctionParam(name=m.name, arguments=m.arguments)
                )
                last = out[-1] if out else None
                if last is not None and last.role == "assistant" and last.tool_calls:
                    last.tool_calls.append(call)
                else:
                    out.append(ChatMessageParam(role="assistant", tool_calls=[call]))
        return out

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise RequestError(
                    'tool_choice must be "none", "auto", "required" or '
                    '{"type": "function", "name": ...}',
                    "tool_choice",
                )
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request that renders and samples the same way."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "kv_transfer_params": self.kv_transfer_params,
        }
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.tool_choice is not None:
            body["tool_choice"] = self._chat_tool_choice()
        return ChatCompletionRequest.model_validate(body)
