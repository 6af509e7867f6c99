"""What the scheduler hands the model runner each step, and what comes back.

The single scheduling vocabulary: ``num_scheduled_tokens[req_id]`` is how many tokens
that request computes this step on top of ``num_computed_tokens``. A prompt chunk, a
decode token and a speculative verify (the last known token plus k drafts) are all
just that number. ``scheduled_spec_decode_tokens[req_id]`` are the drafts among them
(the last ``len(drafts)`` of the request's scheduled tokens); a draft id of ``-1`` is
one the host does not know: under async scheduling the step in flight proposes it on
the device, and where no step proposes one it is a placeholder the runner never
accepts.

The runner answers with a ragged list per request: the tokens it accepted (at least
one for every request that reached its end, more when drafts were accepted), and the
drafts it proposes for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.core_types.kv_connector import KVConnectorMetadata, KVConnectorOutput
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: first schedule, or resumed after preemption."""

    req_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class CachedRequestData:
    """A running request the runner already tracks: only what changed. Its block table
    holds ``num_blocks`` blocks after this step: the first ``num_blocks - len(new)`` it
    had (the scheduler may have given back a tail of rejected draft slots), then
    ``new_block_ids``."""

    req_id: str
    new_block_ids: list[int]
    num_blocks: int
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # batch order = insertion order
    total_num_scheduled_tokens: int
    # drafts among the scheduled tokens, per request that has any (-1: not known here)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # requests whose drafts this step are only placeholders padding a P/D decode's first
    # step to the uniform 1+k shape (never accepted, not counted as drafts)
    padded_spec_decode_req_ids: set[str] = field(default_factory=set)
    # speculative decoding: whether the drafter runs after this step (False on a step the
    # adaptive policy runs with no drafts: it costs what a step without speculation does)
    propose_drafts: bool = True
    # the adaptive draft policy's view of the step: (batch, longest context, j) when every
    # request verifies j drafts (and the step proposes iff j > 0), else None; and when it
    # was scheduled (time.perf_counter), so its landing can report what it cost
    spec_step_shape: tuple[int, int, int] | None = None
    scheduled_at: float = 0.0
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)
    # requests whose step reaches the end of their known tokens: they sample
    sampling_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None
    # structured output: int32 bitmask rows (ceil(vocab / 32) words, bit set = allowed),
    # 1 + its drafts per request of ``structured_req_ids`` (each of which samples this
    # step), one per logits row it samples from: row j follows its first j drafts
    structured_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # bad_words: token ids banned at the sampled row of these requests this step
    bad_word_bans: dict[str, list[int]] = field(default_factory=dict)
    # async scheduling: the bitmask and bans above are filled only after the step's
    # forward is launched and the step before it has landed (``Scheduler.fill_masks``),
    # so the matchers' work overlaps the forward instead of stalling the device
    masks_deferred: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class PromptLogprobsChunk:
    """One step's prompt logprobs of one request: prompt positions ``start`` ..
    ``start + len(logprobs) - 1`` (position p scores prompt token p given tokens < p, so
    ``start`` >= 1). Raw model distribution, float32."""

    start: int
    logprobs: np.ndarray  # [M] float32: the actual prompt token's logprob
    ranks: np.ndarray  # [M] int64: its rank (1 = most likely; ties rank pessimistically)
    top_ids: np.ndarray  # [M, N] int64: the N most likely ids, most likely first
    top_logprobs: np.ndarray  # [M, N] float32


@dataclass
class PromptLogprobs:
    """A request's whole prompt logprobs, for positions 1 .. P-1 (position 0 has none),
    sent once, with the request's first sampled token."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class RunnerOutput:
    req_ids: list[str]  # batch order
    # per request: the accepted tokens (empty for a prompt chunk that did not reach its end)
    sampled_token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None  # of each accepted token, when any request asked
    # per request: drafts for its next step (-1: no draft), when speculation is on
    draft_token_ids: list[list[int]] | None = None
    step_path: str = "eager"  # which forward path ran ("graph" or "eager:<reason>")
    kv_connector_output: KVConnectorOutput | None = None
    # per request, per accepted token: the step's top-N (largest N asked) ids and logprobs
    top_token_ids: list[list[list[int]]] | None = None
    top_logprobs: list[list[list[float]]] | None = None
    # prompt chunks of the requests that asked for prompt_logprobs this step
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # seconds the device spent on the step (CUDA events: from its first upload, or the
    # end of the step before if that was later, to its results' copy), for the adaptive
    # draft policy; None off CUDA and without that policy
    device_s: float | None = None


@dataclass
class EngineCoreOutput:
    """One request's news from one step (engine core -> frontend)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    # per new token: the request's top-N alternatives (ids, logprobs), when N > 0
    new_top_token_ids: list[list[int]] | None = None
    new_top_logprobs: list[list[float]] | None = None
    # prompt_logprobs, on the output that carries the request's first token
    prompt_logprobs: PromptLogprobs | None = None
