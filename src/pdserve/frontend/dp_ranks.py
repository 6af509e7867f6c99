"""The API server's view of a data-parallel instance: which rank owns which request,
where a new request goes, and one stats snapshot and one ready message for all ranks.

Routing: a new request goes to the rank with the fewest unfinished requests this client
sent it (ties: the rank after the one picked last, so equal loads alternate). A request
stays with its rank to the end (its KV lives there); aborts go to the owner.

Stats (:func:`merge_stats`): requests, counters, transfer and speculative counts are
summed over ranks; KV-cache usage is the share of all ranks' blocks in use; the side
channel is healthy when every rank's is; ``num_steps`` and ``step_paths`` sum every
rank's steps (under expert parallelism every rank steps together, idle ones on dummy
forwards, counted as ``dummy:*`` paths); process RSS is kept per rank
(``engine_core_dp<r>``). Each rank's transfer samples (drained per snapshot) are passed
on once, with the snapshot that carried them.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from pdserve.core_types import messages as M
from pdserve.core_types.stats import SchedulerStats


class RankRouter:
    """Request ownership and load per rank (unfinished requests this client sent)."""

    def __init__(self, num_ranks: int) -> None:
        self.load = [0] * num_ranks
        self.owner: dict[str, int] = {}
        self._last = num_ranks - 1

    def assign(self, request_id: str) -> int:
        n = len(self.load)
        order = [(self._last + 1 + i) % n for i in range(n)]
        rank = min(order, key=lambda r: self.load[r])
        self._last = rank
        self.load[rank] += 1
        self.owner[request_id] = rank
        return rank

    def release(self, request_id: str) -> None:
        rank = self.owner.pop(request_id, None)
        if rank is not None:
            self.load[rank] -= 1


def merge_ready(ready: list[M.EngineReady]) -> M.EngineReady:
    """One ready message for the instance: rank 0's, with every rank's KV blocks summed,
    their devices listed and the slowest start-up."""
    first = ready[0]
    return msgspec.structs.replace(
        first,
        num_blocks=sum(r.num_blocks for r in ready),
        device=",".join(r.device for r in ready),
        startup_seconds=max(r.startup_seconds for r in ready),
    )


def _sum_dicts(dicts: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for d in dicts:
        total.update(d)
    return dict(total)


def _sum_lists(lists: list[list[int]]) -> list[int]:
    """Element-wise sums of lists of any lengths (missing entries count 0)."""
    total: list[int] = []
    for values in lists:
        for i, n in enumerate(values):
            total.extend([0] * (i + 1 - len(total)))
            total[i] += n
    return total


def merge_stats(
    per_rank: list[SchedulerStats],
    blocks: list[int],
    rss: dict[str, int],
    fresh: SchedulerStats,
) -> SchedulerStats:
    """The instance's snapshot from each rank's latest one (see the module docstring).
    ``fresh``: the snapshot just received (its transfer samples are the ones passed on);
    ``rss``: the latest RSS reading per rank key."""
    s = per_rank
    used = sum(x.kv_cache_usage * b for x, b in zip(s, blocks, strict=True))
    per_pos = _sum_lists([x.spec_num_accepted_tokens_per_pos for x in s])
    unhealthy = [
        f"rank {r}: {x.kv_transfer_unhealthy_reason}"
        for r, x in enumerate(s)
        if not x.kv_transfer_healthy
    ]
    return SchedulerStats(
        num_running_reqs=sum(x.num_running_reqs for x in s),
        num_waiting_reqs=sum(x.num_waiting_reqs for x in s),
        num_waiting_for_remote_kv=sum(x.num_waiting_for_remote_kv for x in s),
        kv_cache_usage=used / max(sum(blocks), 1),
        prefix_cache_queries=sum(x.prefix_cache_queries for x in s),
        prefix_cache_hits=sum(x.prefix_cache_hits for x in s),
        num_preemptions=sum(x.num_preemptions for x in s),
        prompt_tokens_by_source=_sum_dicts([x.prompt_tokens_by_source for x in s]),
        step_paths=_sum_dicts([x.step_paths for x in s]),
        num_steps=sum(x.num_steps for x in s),
        kv_transfer_failures=sum(x.kv_transfer_failures for x in s),
        kv_leases_expired=sum(x.kv_leases_expired for x in s),
        kv_held_for_remote_decode=sum(x.kv_held_for_remote_decode for x in s),
        kv_transfer_seconds=list(fresh.kv_transfer_seconds),
        kv_transfer_bytes=list(fresh.kv_transfer_bytes),
        kv_transfer_healthy=not unhealthy,
        kv_transfer_unhealthy_reason="; ".join(unhealthy),
        kv_transfer_restarts=sum(x.kv_transfer_restarts for x in s),
        kv_side_channel_rejected=_sum_dicts([x.kv_side_channel_rejected for x in s]),
        spec_num_drafts=sum(x.spec_num_drafts for x in s),
        spec_num_draft_tokens=sum(x.spec_num_draft_tokens for x in s),
        spec_num_accepted_tokens=sum(x.spec_num_accepted_tokens for x in s),
        spec_num_accepted_tokens_per_pos=per_pos,
        spec_num_padded_steps=sum(x.spec_num_padded_steps for x in s),
        spec_steps_by_num_drafts=_sum_lists([x.spec_steps_by_num_drafts for x in s]),
        spec_last_num_drafts=max((x.spec_last_num_drafts for x in s), default=0),
        num_generated_tokens=sum(x.num_generated_tokens for x in s),
        dp_step_agreements=sum(x.dp_step_agreements for x in s),
        process_rss_bytes=dict(rss),
    )
