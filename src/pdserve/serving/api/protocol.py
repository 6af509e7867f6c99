"""OpenAI-compatible request/response models (pydantic v2) of the API server.

Validation policy: these models check a request's JSON shape (types, unknown fields,
which fields go together) and map it to :class:`SamplingParams`; the rules on values
(ranges, lengths against ``max_model_len``, the vocabulary, P/D limits, the scheduling
policy) are the input processor's (:mod:`pdserve.frontend.processor`), which the
handlers call; every rejection names the field. Fields pdserve does not implement are **rejected**, never
silently ignored, when they would change the output (``best_of`` other than ``n``,
``suffix``, ``priority`` other than 0 unless the server runs
``--scheduling-policy priority``); unknown fields are rejected too (``extra="forbid"``).
Fields that only carry bookkeeping (``user``, ``metadata``, ``store``, ``service_tier``)
are accepted and ignored. ``parallel_tool_calls=false`` keeps the first parsed tool call
only (:mod:`pdserve.serving.api.chat_output`). Structured output (``response_format``,
``structured_outputs``, ``guided_*``): :mod:`pdserve.serving.api.protocol_structured`.

vLLM extras: ``truncate_prompt_tokens`` (keep the last N prompt tokens; ``-1``: the last
``max_model_len``) is implemented. ``cache_salt`` is accepted and has no effect: the
engine's prefix cache is not partitioned by salt, so requests with different salts can
still share cached prefixes (the isolation the salt asks for is not provided).
``spaces_between_special_tokens`` is accepted and has no effect: pdserve decodes with
the fast tokenizer's own decoder, which never inserts spaces between added tokens (so
both values give the same text).

Validators raise :class:`RequestError` (a ``ValueError`` carrying the offending
parameter name); the server maps it to HTTP 400 with an OpenAI error body. Before any
other check, a request body holding a lone UTF-16 surrogate in any string (``"\\ud800"``)
is refused, naming the field (:mod:`pdserve.serving.api.unicode_check`).

``n`` (1..64): n independent samples, returned as choices ``0 .. n-1`` (a stream's
chunks carry their choice's index); usage counts the prompt once and every choice's
completion tokens. The handlers fan the request out into n engine requests that share
the prompt's KV through the prefix cache (:mod:`pdserve.frontend.parallel`; with a
``seed``, sample i uses ``seed + i``). On a P/D decode instance (``kv_transfer_params``
with ``do_remote_prefill``) sample 0 pulls the prompt's KV and the others start once it
has, sharing it; a prefill leg (``do_remote_decode``) takes n=1 only.

``prompt_logprobs`` (vLLM's extra, 0..20): for each prompt token after the first, its
logprob and rank and the N most likely tokens at that position (the first is
``null``), in the completion choice's ``prompt_logprobs`` (every choice) and at the top
of a chat response (vLLM's extension); streamed, they come with each choice's first
chunk (completions) or the stream's first chunk (chat), where vLLM refuses them. The
request computes its whole prompt (no prefix-cache hits). Refused with P/D remote
prefill params (the prompt's KV is pulled, its logits are never computed). ``echo`` with
``logprobs=N`` asks for at least N of them (as vLLM does), under the same rule.

Logprobs: the sampled token's logprob and, for completions ``logprobs=N`` / chat
``top_logprobs=N`` (N <= 20), the N most likely tokens at each position, all under the
model's raw distribution (before ``logit_bias``, temperature and filters), as vLLM
returns them by default. Chat ``top_logprobs`` > 0 needs ``logprobs=true``.
``logit_bias`` (token id -> bias in [-100, 100], added to the logits) and the vLLM extra
``allowed_token_ids`` (every other id masked out) are applied on the device, and so are
``presence_penalty`` / ``frequency_penalty`` (over the output tokens) and
``repetition_penalty`` (prompt and output) with vLLM's definitions; the vLLM extra
``bad_words`` (banned as vLLM bans them: as given and after a space; a sequence's last
token is masked where the output ends with the rest) is refused with speculation.

``kv_transfer_params`` stays a plain JSON object here: its signature is checked first
(403 when it does not verify) and its fields are parsed after that
(:mod:`pdserve.serving.api.pd_params`), so this model checks only that it is an object.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pdserve.core_types.sampling_params import SamplingParams
from pdserve.serving.api.protocol_base import CheckedModel as _CheckedRequest
from pdserve.serving.api.protocol_base import (
    PromptLogprob,
    PromptLogprobs,
    PromptTokenUsageInfo,
    RequestError,
    UsageInfo,
)
from pdserve.serving.api.protocol_base import ResponseModel as _Response
from pdserve.serving.api.protocol_base import StrictModel as _Request
from pdserve.serving.api.protocol_chat import (
    ChatCompletionLogProbs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatMessage,
    ChatTool,
    DeltaMessage,
    ToolCallParam,
    ToolChoice,
    check_tool_choice,
    forced_tool_schema,
)
from pdserve.serving.api.protocol_structured import (
    ResponseFormat,
    StructuredFields,
    StructuredOutputsParams,
)

__all__ = [
    "ChatCompletionLogProbs",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatLogProb",
    "ChatLogProbsContent",
    "ChatMessage",
    "DeltaMessage",
    "PromptLogprob",
    "PromptLogprobs",
    "PromptTokenUsageInfo",
    "RequestError",
    "ResponseFormat",
    "UsageInfo",
]

# the request fields the input processor's rules name (param of a 400), where an
# endpoint names them otherwise than SamplingParams does ("prompt": the prompt's field)
COMPLETION_FIELDS: dict[str, str] = {}
CHAT_FIELDS = {"prompt": "messages", "logprobs": "top_logprobs"}

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


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


class _SamplingRequest(_CheckedRequest, StructuredFields):
    """Sampling fields shared by completions and chat completions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    n: int | None = 1
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # bookkeeping, ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM extras (see the module docstring)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    cache_salt: str | None = Field(None, min_length=1)
    priority: int = Field(0, ge=_INT64_MIN, le=_INT64_MAX)  # lower first (priority policy)
    spaces_between_special_tokens: bool = True
    # P/D: verified and parsed by the handlers (pd_params), passed to the engine;
    # the engine's are returned in the (non-streaming) response
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_shared(self) -> _SamplingRequest:
        for key in self.logit_bias or {}:
            try:
                int(key)
            except ValueError:
                raise RequestError(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                ) from None
        if self.truncate_prompt_tokens == 0:
            raise RequestError(
                "truncate_prompt_tokens must be >= 1 (or -1 for max_model_len)",
                "truncate_prompt_tokens",
            )
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options can only be set when stream=true", "stream_options")
        self.constraint()  # refuses two output constraints at once
        return self

    def constraint(self) -> tuple[StructuredOutputsParams, str] | None:
        """The request's output constraint and the field it came from (or None)."""
        return self.structured_spec()

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """``ids`` cut to their last ``truncate_prompt_tokens`` (when set)."""
        n = self.truncate_prompt_tokens
        if n is None:
            return ids
        if n == -1:
            n = max_model_len
        elif n > max_model_len:
            raise RequestError(
                f"truncate_prompt_tokens={n} is larger than max_model_len={max_model_len}",
                "truncate_prompt_tokens",
            )
        return ids[-n:]

    def _sampling_params(
        self,
        *,
        max_tokens: int | None,
        prompt_len: int,
        max_model_len: int,
        vocab_size: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
    ) -> SamplingParams:
        if max_tokens is None:  # up to the context length
            max_tokens = max_model_len - prompt_len
        top_k = self.top_k if self.top_k is not None else 0
        if top_k >= vocab_size:
            top_k = 0  # keeping the whole vocabulary is the same as no top-k
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            n=1 if self.n is None else self.n,
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
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()}
            if self.logit_bias
            else None,
            allowed_token_ids=list(self.allowed_token_ids)
            if self.allowed_token_ids is not None
            else None,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            priority=self.priority,
            bad_words=list(self.bad_words) if self.bad_words else None,
        )
        constraint = self.constraint()
        if constraint is not None:
            params.structured_outputs = constraint[0]
        return params


# ---------------------------------------------------------------- /v1/completions


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string or token ids, or a list of them
    (:mod:`.completions_batch`; a one-element list is unwrapped). ``max_tokens``
    defaults to 16 as in OpenAI; ``null`` means "up to the context length"
    (``max_model_len - prompt_len``); 0 (with ``echo`` only) means none: the engine
    samples one token that the answer leaves out."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and not isinstance(p[0], int):
            self.prompt = p[0]
        if any(isinstance(q, list | str) and not q for q in self.prompts()):
            raise RequestError("prompt must not be empty", "prompt")
        if len(self.prompts()) > 1 and self.kv_transfer_params is not None:
            raise RequestError("a list of prompts cannot carry kv_transfer_params", "prompt")
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens=0 needs echo=true (to score the prompt)", "max_tokens")
        if self.max_tokens == 0 and self.min_tokens:
            raise RequestError(f"min_tokens={self.min_tokens} > max_tokens=0", "min_tokens")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestError(
                f"best_of={self.best_of} is not supported: pdserve returns every sample it "
                f"draws, so best_of must equal n ({self.n or 1}) or be left out",
                "best_of",
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch's."""
        p = self.prompt
        batch = isinstance(p, list) and p and not isinstance(p[0], int)
        return list(p) if batch else [p]  # type: ignore[arg-type, list-item]

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (valid only after validation)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        return [int(t) for t in p]  # type: ignore[arg-type]  # unwrapped by the validator

    def to_sampling_params(
        self, *, prompt_len: int, max_model_len: int, vocab_size: int
    ) -> SamplingParams:
        """The request's :class:`SamplingParams`, to be checked by the input processor
        (:meth:`~pdserve.frontend.processor.InputProcessor.check`)."""
        echoed = self.logprobs if self.echo else None  # the echoed prompt's, at least N
        asked = [k for k in (self.prompt_logprobs, echoed) if k is not None]
        return self._sampling_params(
            max_tokens=1 if self.max_tokens == 0 else self.max_tokens,
            prompt_len=prompt_len,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            logprobs=self.logprobs,
            prompt_logprobs=max(asked) if asked else None,
        )


class CompletionLogProbs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None


class CompletionResponseChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


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
    prompt_logprobs: PromptLogprobs | None = None  # with the choice's first chunk


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None

    def to_json(self) -> str:
        """JSON of the chunk (the same call as for a chat chunk); ``prompt_logprobs`` only
        where a choice has them."""
        if any(c.prompt_logprobs is not None for c in self.choices):
            return self.model_dump_json()
        return self.model_dump_json(exclude={"choices": {"__all__": {"prompt_logprobs"}}})


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
    tool_calls: list[ToolCallParam] | None = None


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

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise RequestError(
                f"top_logprobs={self.top_logprobs} needs logprobs=true", "top_logprobs"
            )
        check_tool_choice(self.tools, self.tool_choice)
        return self

    @property
    def effective_tool_choice(self) -> str:
        """``"none"``, ``"auto"``, ``"required"`` or ``"named"``."""
        return check_tool_choice(self.tools, self.tool_choice)

    def constraint(self) -> tuple[StructuredOutputsParams, str] | None:
        """The output constraint: the structured-output fields', or the forced tool
        calls' of ``tool_choice`` required / named (not both)."""
        found = self.structured_spec()
        tools = forced_tool_schema(self.tools, self.tool_choice, self.parallel_tool_calls)
        if tools is None:
            return found
        if found is not None:
            raise RequestError(
                f"tool_choice={self.effective_tool_choice!r} cannot be combined with "
                f"{found[1]}: a request takes one output constraint",
                "tool_choice",
            )
        return StructuredOutputsParams(json=tools), "tool_choice"

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as plain dicts (what chat templates and tool parsers read)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def to_sampling_params(
        self, *, prompt_len: int, max_model_len: int, vocab_size: int
    ) -> SamplingParams:
        """The request's :class:`SamplingParams`, to be checked by the input processor
        (field names: :data:`CHAT_FIELDS`)."""
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        return self._sampling_params(
            max_tokens=max_tokens,
            prompt_len=prompt_len,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            prompt_logprobs=self.prompt_logprobs,
        )


# ---------------------------------------------------------------- /tokenize, /detokenize


class TokenizeCompletionRequest(_CheckedRequest):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatTemplateFields):
    model: str | None = None
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None  # rendered by the template, as for chat


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
    """``POST /v1/kv_transfer/release``: free the KV held for ``request_id``; signed by
    the proxy like ``kv_transfer_params`` (:mod:`pdserve.serving.api.pd_params`)."""

    request_id: str = Field(min_length=1, max_length=512)
    pd_expires: float | None = None
    pd_nonce: str | None = Field(default=None, max_length=64)
    pd_signature: str | None = Field(default=None, max_length=256)
