"""``POST /v1/responses`` (OpenAI's Responses API): the request model.

Supported: ``input`` as a text or as a list of message items (``role`` user, system,
developer or assistant; ``content`` a text or ``input_text`` / ``output_text``
parts), ``instructions`` (a system message first), ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``; bookkeeping fields (``metadata``, ``user``,
``store``, ``service_tier``, ``parallel_tool_calls``) are accepted and ignored
(nothing is stored). Refused with 400: ``tools`` (use ``/v1/chat/completions`` for
tool calling), a ``tool_choice`` other than none/auto, ``previous_response_id`` and
``conversation`` (the server keeps no state), ``background``, ``include``,
``top_logprobs``, a ``text.format`` other than text, ``truncation="auto"``, ``reasoning``
settings, and input items of other types (function calls, images, files).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pdserve.serving.api.protocol import ChatCompletionRequest, ChatMessageParam
from pdserve.serving.api.protocol_base import CheckedModel, RequestError, StrictModel

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


class ResponsesRequest(CheckedModel):
    model: str | None = None
    input: str | list[ResponseInputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
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
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.tools:
            raise RequestError(
                "tools are not supported on /v1/responses yet; use /v1/chat/completions "
                "for tool calling",
                "tools",
            )
        if self.tool_choice not in (None, "none", "auto"):
            raise RequestError(
                "tool_choice needs tools, which /v1/responses does not support", "tool_choice"
            )
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
        out = []
        if self.instructions:
            out.append(ChatMessageParam(role="system", content=self.instructions))
        if isinstance(self.input, str):
            out.append(ChatMessageParam(role="user", content=self.input))
        else:
            out.extend(ChatMessageParam(role=m.role, content=m.text()) for m in self.input)
        return out

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request that renders and samples the same way."""
        return ChatCompletionRequest.model_validate(
            {
                "model": self.model,
                "messages": self.messages(),
                "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
            }
        )
