"""One request's engine-side state and its state machine.

States: WAITING -> [WAITING_FOR_REMOTE_KV] -> RUNNING <-> PREEMPTED -> FINISHED_*.
A request's progress is ``num_computed_tokens`` over ``all_token_ids`` (prompt +
output so far); each step the scheduler gives it some number of tokens to compute
on top of that. Preemption frees its blocks and resets ``num_computed_tokens`` to 0
(recompute); its output tokens are kept and recomputed as part of the prefix.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    kv_transfer_params: dict | None = None
    # computed limits (set by the processor): absolute cap on output tokens
    max_output_tokens: int = 16

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    # tokens sampled by a step still in flight (async scheduling): computed, not yet known
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1  # prompt tokens hit in the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    # block hashes of full blocks of all_token_ids, extended lazily by the KV manager
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_at(self, idx: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[idx] if idx < n else self.output_token_ids[idx - n]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
