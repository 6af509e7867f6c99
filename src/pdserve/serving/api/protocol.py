"""OpenAI-compatible request/response models (pydantic v2) of the API server.

Validation policy: a request is checked completely here, at the edge, and every
rejection names the field. Fields pdserve does not implement are **rejected**, never
silently ignored, when they would change the output (``n``/``best_of`` > 1, penalties,
``logit_bias``, ``echo``, ``suffix``, non-text ``response_format``, tools, batched
prompts); unknown fields are rejected too (``extra="forbid"``). Fields that only carry
bookkeeping (``user``, ``metadata``, ``store``, ``service_tier``,
``parallel_tool_calls``) are accepted and ignored.

Validators raise :class:`RequestError` (a ``ValueError`` carrying the offending
parameter name); the server maps it to HTTP 400 with an OpenAI error body. Before any
other check, a request body holding a lone UTF-16 surrogate in any string (``"\\ud800"``)
is refused, naming the field (:mod:`pdserve.serving.api.unicode_check`).

Logprobs: pdserve returns the sampled token's logprob only, so completions
``logprobs`` > 0 and chat ``top_logprobs`` > 0 (requests for alternatives) are refused.

``kv_transfer_params`` stays a plain JSON object here: its signature is checked first
(403 when it does not verify) and its fields are parsed after that
(:mod:`pdserve.serving.api.pd_params`), so this model checks only that it is an object.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.core_types.sampling_params import SamplingParams
from pdserve.serving.api.unicode_check import find_lone_surrogate, lone_surrogate_message

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20


class RequestError(ValueError):
    """Invalid user input; becomes HTTP 400. ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _CheckedRequest(_Request):
    """A top-level request body: refuses lone surrogates anywhere in it, first."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        hit = find_lone_surrogate(data)
        if hit is not None:
            raise RequestError(lone_surrogate_message(*hit), hit[0])
        return data


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- errors, models


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Response):
    error: ErrorInfo


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- shared request parts


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_CheckedRequest):
    """Sampling fields shared by completions and chat completions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # accepted only at their no-op values
    n: int | None = 1
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None
    # bookkeeping, ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # P/D: verified and parsed by the handlers (pd_params), passed to the engine;
    # the engine's are returned in the (non-streaming) response
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_shared(self) -> _SamplingRequest:
        if self.n not in (None, 1):
            raise RequestError(
                f"n={self.n} is not supported: pdserve returns one choice per request", "n"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0.0):
                raise RequestError(f"{name}={value} is not supported (only 0)", name)
        if self.repetition_penalty not in (None, 1.0):
            raise RequestError(
                f"repetition_penalty={self.repetition_penalty} is not supported (only 1.0)",
                "repetition_penalty",
            )
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options can only be set when stream=true", "stream_options")
        if self.stop == "" or (isinstance(self.stop, list) and any(not s for s in self.stop)):
            raise RequestError("stop strings must be non-empty", "stop")
        return self

    def _sampling_params(
        self,
        *,
        max_tokens: int | None,
        prompt_len: int,
        max_model_len: int,
        vocab_size: int,
        logprobs: int | None,
        length_param: str,
    ) -> SamplingParams:
        if prompt_len >= max_model_len:
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens, but the "
                f"prompt has {prompt_len} tokens, leaving no room to generate. "
                "Please reduce the length of the prompt.",
                length_param,
            )
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
        elif prompt_len + max_tokens > max_model_len:
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the length of the prompt "
                "or the number of completion tokens.",
                "max_tokens",
            )
        top_k = self.top_k if self.top_k is not None else 0
        if top_k >= vocab_size:
            top_k = 0  # keeping the whole vocabulary is the same as no top-k
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            n=1,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        try:
            params.verify(vocab_size)
        except ValueError as e:
            raise RequestError(str(e)) from e
        return params


# ---------------------------------------------------------------- /v1/completions


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt`` is one prompt: a string or a list of token ids
    (a one-element batch is unwrapped; larger batches are rejected).

    ``max_tokens`` defaults to 16 as in OpenAI; an explicit ``null`` means "up to the
    context length" (``max_model_len - prompt_len``).
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) > 1:
                raise RequestError(
                    f"batched prompts are not supported (got {len(p)} prompts); "
                    "send one prompt per request",
                    "prompt",
                )
            self.prompt = p[0]
        if isinstance(self.prompt, list) and not self.prompt:
            raise RequestError("prompt must not be empty", "prompt")
        if self.echo:
            raise RequestError("echo=true is not supported", "echo")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise RequestError(f"best_of={self.best_of} is not supported (only 1)", "best_of")
        if self.logprobs:
            raise RequestError(
                f"logprobs={self.logprobs} is not supported: only the sampled token's logprob "
                "is returned (set logprobs=0)",
                "logprobs",
            )
        return self

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (valid only after validation)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        return [int(t) for t in p]  # type: ignore[arg-type]  # unwrapped by the validator

    def to_sampling_params(
        self, *, prompt_len: int, max_model_len: int, vocab_size: int
    ) -> SamplingParams:
        """Verified :class:`SamplingParams`; raises :class:`RequestError` for bad input
        (including prompt + max_tokens beyond ``max_model_len``)."""
        return self._sampling_params(
            max_tokens=self.max_tokens,
            prompt_len=prompt_len,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            logprobs=self.logprobs,
            length_param="prompt",
        )


class CompletionLogProbs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None


class PromptTokenUsageInfo(_Response):
    cached_tokens: int | None = None


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class CompletionResponseChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None

    def to_json(self) -> str:
        """JSON of the chunk (the same call as for a chat chunk)."""
        return self.model_dump_json()


# ---------------------------------------------------------------- /v1/chat/completions


class TextContentPart(_Request):
    type: str
    text: str = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise RequestError(
                f"content part type {v!r} is not supported; pdserve serves text only", "messages"
            )
        return v


class ChatMessageParam(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ResponseFormat(_Request):
    type: str
    json_schema: dict[str, Any] | None = None


_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"chat_template", "add_generation_prompt", "messages", "conversation", "tokenize", "tools"}
)


class _ChatTemplateFields(_CheckedRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        bad = sorted(set(v or {}) & _RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise RequestError(
                f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs"
            )
        return v


class ChatCompletionRequest(_SamplingRequest, _ChatTemplateFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over the deprecated
    ``max_tokens``; when neither is set the request may use the rest of the context."""

    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs:
            raise RequestError(
                f"top_logprobs={self.top_logprobs} is not supported: only the sampled token's "
                "logprob is returned (set logprobs=true, top_logprobs=0)",
                "top_logprobs",
            )
        if self.response_format is not None and self.response_format.type != "text":
            raise RequestError(
                f"response_format type {self.response_format.type!r} is not supported "
                "(only 'text')",
                "response_format",
            )
        if self.tools:
            raise RequestError("tools are not supported", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise RequestError("tool_choice is not supported", "tool_choice")
        return self

    def to_sampling_params(
        self, *, prompt_len: int, max_model_len: int, vocab_size: int
    ) -> SamplingParams:
        """Verified :class:`SamplingParams`; raises :class:`RequestError` for bad input."""
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        return self._sampling_params(
            max_tokens=max_tokens,
            prompt_len=prompt_len,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            logprobs=0 if self.logprobs else None,
            length_param="messages",
        )


class ChatMessage(_Response):
    role: str = "assistant"
    content: str | None = None


class DeltaMessage(_Response):
    """A streamed delta; ``None`` fields are left out of the JSON."""

    role: str | None = None
    content: str | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class ChatLogProb(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(_Response):
    content: list[ChatLogProbsContent] | None = None


class ChatCompletionResponseChoice(_Response):
    index: int = 0
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ChatCompletionStreamChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
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


# ---------------------------------------------------------------- /tokenize, /detokenize


class TokenizeCompletionRequest(_CheckedRequest):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatTemplateFields):
    model: str | None = None
    return_token_strs: bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_CheckedRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


class ReleaseKVRequest(_CheckedRequest):
    """``POST /v1/kv_transfer/release``: free the KV a prefill instance holds for
    ``request_id``. Signed by the proxy like ``kv_transfer_params`` (``pd_expires``,
    ``pd_signature``; :mod:`pdserve.serving.api.pd_params`)."""

    request_id: str = Field(min_length=1, max_length=512)
    pd_expires: float | None = None
    pd_signature: str | None = Field(default=None, max_length=256)
