"""What the scheduler hands the model runner each step, and what comes back.

The single scheduling vocabulary: ``num_scheduled_tokens[req_id]`` is how many tokens
that request computes this step on top of ``num_computed_tokens``. A prompt chunk, a
decode token and (later) a 1+k speculative verify are all just that number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput


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
    """A running request the runner already tracks: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # batch order = insertion order
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)
    # requests whose step reaches the end of their known tokens: they sample a token
    sampling_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class RunnerOutput:
    req_ids: list[str]  # batch order
    sampled_token_ids: list[int]  # one per request; ignored for partial prefill chunks
    logprobs: list[float] | None = None  # logprob of each sampled token, when any request asked
    step_path: str = "eager"  # which forward path ran ("graph" or "eager:<reason>")
    kv_connector_output: KVConnectorOutput | None = None


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
    kv_transfer_params: dict | None = None
