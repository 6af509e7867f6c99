"""User-facing outputs, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.core_types.kv_transfer_params import KVTransferParams


@dataclass
class Logprob:
    """One token's logprob and rank (1 = most likely), as vLLM's ``Logprob``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: one entry per prompt token, None for the first; each maps the
# actual token and the top-N alternatives (token id -> Logprob), the actual token first
PromptLogprobList = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion. In streaming (delta) mode ``text``/``token_ids``/``logprobs`` hold only
    what is new since the previous output of the same request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[float] | None = None  # logprob of each sampled token, when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # per sampled token: its top-N alternatives, token id -> logprob (most likely first),
    # when N > 0 was asked
    top_logprobs: list[dict[int, float]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (or transferred)
    error: str | None = None  # set when finish_reason is "error"
    kv_transfer_params: KVTransferParams | None = None
    metrics: dict = field(default_factory=dict)
    # prompt_logprobs, when asked: on every output (final-only mode) or, in delta mode,
    # on the first output that has them
    prompt_logprobs: PromptLogprobList | None = None
