"""One request's engine-side state and its state machine.

States: WAITING -> [WAITING_FOR_REMOTE_KV] -> RUNNING <-> PREEMPTED -> FINISHED_*.
A request's progress is ``num_computed_tokens`` over ``all_token_ids()`` (prompt +
output so far); each step the scheduler gives it some number of tokens to compute
on top of that. Preemption frees its blocks and resets ``num_computed_tokens`` to 0
(recompute); its output tokens are kept and recomputed as part of the prefix.

A request is made from the frontend's validated :class:`EngineCoreRequest` and from
nothing else.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np

from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.messages import EngineCoreRequest
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.core_types.scheduler_output import PromptLogprobs, PromptLogprobsChunk

if TYPE_CHECKING:
    from pdserve.engine.structured_output import RequestGrammar


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


class PromptLogprobsAccumulator:
    """A request's prompt logprobs as its prefill chunks land, by position (so a chunk
    recomputed after a preemption rewrites the same values); taken once, whole."""

    def __init__(self, num_prompt_tokens: int, n: int) -> None:
        m = max(num_prompt_tokens - 1, 0)
        self.logprobs = np.zeros(m, dtype=np.float32)
        self.ranks = np.zeros(m, dtype=np.int64)
        self.top_ids = np.zeros((m, n), dtype=np.int64)
        self.top_logprobs = np.zeros((m, n), dtype=np.float32)

    def add(self, chunk: PromptLogprobsChunk) -> None:
        a = chunk.start - 1
        b = a + len(chunk.logprobs)
        self.logprobs[a:b] = chunk.logprobs
        self.ranks[a:b] = chunk.ranks
        self.top_ids[a:b] = chunk.top_ids
        self.top_logprobs[a:b] = chunk.top_logprobs

    def take(self) -> PromptLogprobs:
        return PromptLogprobs(
            self.logprobs.tolist(),
            self.ranks.tolist(),
            self.top_ids.tolist(),
            self.top_logprobs.tolist(),
        )


class Request:
    def __init__(self, r: EngineCoreRequest) -> None:
        self.request_id: str = r.request_id
        self.prompt_token_ids: list[int] = r.prompt_token_ids
        self.sampling_params: SamplingParams = r.sampling_params
        self.priority = r.sampling_params.priority  # lower first (--scheduling-policy priority)
        self.eos_token_ids = frozenset(r.eos_token_ids)
        self.arrival_time = r.arrival_time
        self.kv_transfer_params: KVTransferParams | None = r.kv_transfer_params
        self.max_output_tokens = r.max_output_tokens  # absolute cap on output tokens
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # tokens a step still in flight produces (async scheduling): computed, not yet
        # known; a verify counts all its drafts plus one until its result lands
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prompt tokens hit in the prefix cache at first schedule
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # block hashes of full blocks of all_token_ids, extended lazily by the KV manager
        self.block_hashes: list[bytes] = []
        # drafts for the next step that the host knows (synchronous scheduling)
        self.spec_token_ids: list[int] = []
        # the last step it was scheduled to sample in runs the drafter (its drafts, once
        # proposed on the device, are what it verifies next under async scheduling)
        self.drafts_in_flight = False
        # the matcher of a constrained request (structured output), set once compiled
        self.grammar: RequestGrammar | None = None
        self.bad_words: list[list[int]] = list(r.sampling_params.bad_words_token_ids or [])
        # prompt_logprobs: filled chunk by chunk, sent with the first token, then None
        n = r.sampling_params.prompt_logprobs
        self.prompt_logprobs = (
            PromptLogprobsAccumulator(len(r.prompt_token_ids), n) if n is not None else None
        )

    @property
    def skips_prefix_cache(self) -> bool:
        """prompt_logprobs need the logits of every prompt position: nothing is reused."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def needs_landed_tokens(self) -> bool:
        """Its next step's mask depends on its latest token: structured output, or a bad
        word of several tokens."""
        return self.grammar is not None or any(len(s) > 1 for s in self.bad_words)

    def verified_drafts(self, scheduled: list[int]) -> list[int]:
        """The drafts a verify of ``scheduled`` checks, as the host knows them: a ``-1``
        placeholder stands for what the device filled in, the latest landed proposal
        (``spec_token_ids``; -1 where the drafter found none)."""
        known = self.spec_token_ids
        return [d if d >= 0 or j >= len(known) else known[j] for j, d in enumerate(scheduled)]

    def bad_word_bans(self) -> list[int]:
        """Token ids banned next: each bad word's last token where the output ends with
        the rest of the word."""
        out = self.output_token_ids
        bans = []
        for seq in self.bad_words:
            head = seq[:-1]
            if not head or (len(out) >= len(head) and out[len(out) - len(head) :] == head):
                bans.append(seq[-1])
        return bans

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

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

    @property
    def finished_normally(self) -> bool:
        return self.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
