"""Budget, admission and preemption: which requests compute how many tokens in a step.

Running requests go first, in queue order: each gets what it still needs (its tokens,
those in flight included, less those computed) up to the step's token budget, plus the
drafts it verifies. When the pool is short of blocks for it, running requests not yet
scheduled in the step are preempted (recompute: blocks freed, progress reset, back to
the waiting queue) until it fits; if it is itself the victim, the walk ends.

Then, unless the step preempted, waiting requests are admitted from the queue's head
while the budget, ``max_num_seqs`` and free blocks allow: their prefix-cache hits count
as computed, the prompt is chunked to fit the budget (without chunked prefill it waits
whole), and a P/D decode's first step may be padded to the uniform verify shape.

With ``num_lookahead_tokens`` (MTP drafting writes its KV up to k positions past a step)
every allocation reserves that many slots past the step, never past ``max_model_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.core_types.scheduler_output import CachedRequestData, NewRequestData
from pdserve.core_types.stats import SchedulerStats
from pdserve.engine.kv_cache.block_pool import KVCacheBlock
from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sched.placeholders import Placeholders
from pdserve.engine.sched.queues import Queues
from pdserve.engine.sched.remote_kv import RemoteKV
from pdserve.engine.sched.spec import SpecSchedule


@dataclass
class StepBatch:
    """What a step was given, before it becomes a ``SchedulerOutput``."""

    budget: int  # tokens left
    num_tokens: dict[str, int] = field(default_factory=dict)  # batch order
    new: list[NewRequestData] = field(default_factory=list)
    cached: list[CachedRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    padded: set[str] = field(default_factory=set)


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        queues: Queues,
        placeholders: Placeholders,
        spec: SpecSchedule,
        remote: RemoteKV,
        max_model_len: int,
        num_lookahead_tokens: int,
    ) -> None:
        self.config = config
        self.kv = kv
        self.queues = queues
        self.placeholders = placeholders
        self.spec = spec
        self.remote = remote
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens

    def step(self, stats: SchedulerStats, masks_first: bool) -> StepBatch:
        """Fill one step: running requests, then admissions. ``masks_first``: masks are
        filled before the step's forward (see :mod:`pdserve.engine.sched.masks`)."""
        b = StepBatch(self.config.max_num_batched_tokens)
        self._running(b, stats, masks_first)
        self._admit(b, stats)
        return b

    def _running(self, b: StepBatch, stats: SchedulerStats, masks_first: bool) -> None:
        # the hot loop of a decode step (once per running request): bound methods and the
        # budget are locals
        running = self.queues.running
        holds_back, end = self.placeholders.holds_back, self.placeholders.end
        drafts_for = self.spec.drafts if self.spec.k else None
        allocate, ahead, num_blocks = self.kv.allocate_slots, self._ahead, self.kv.num_blocks
        num_tokens, all_drafts, cached = b.num_tokens, b.drafts, b.cached
        budget = b.budget
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.num_output_placeholders and holds_back(req, masks_first):
                i += 1
                continue
            n = min(end(req) - req.num_computed_tokens, budget)
            drafts = drafts_for(req, n, budget) if drafts_for is not None else None
            if drafts:
                n += len(drafts)
            blocks = allocate(req, n, num_lookahead_tokens=ahead(req, n))
            if blocks is None:
                b.budget = budget
                blocks = self._preempt_for(req, n, i, b, stats)
                if blocks is None:
                    break
            rid = req.request_id
            num_tokens[rid] = n
            if drafts:
                all_drafts[rid] = drafts
            cached.append(
                CachedRequestData(
                    rid, [blk.block_id for blk in blocks], num_blocks(rid), req.num_computed_tokens
                )
            )
            budget -= n
            i += 1
        b.budget = budget

    def _preempt_for(
        self, req: Request, n: int, i: int, b: StepBatch, stats: SchedulerStats
    ) -> list[KVCacheBlock] | None:
        """Blocks for ``running[i]``'s ``n`` tokens that did not fit: preempt until they
        do; None when it was preempted itself."""
        while True:
            victim = self.queues.victim(i)  # never one already scheduled this step
            self.preempt(victim, stats)
            b.preempted.add(victim.request_id)
            if victim is req:
                return None
            blocks = self.kv.allocate_slots(req, n, num_lookahead_tokens=self._ahead(req, n))
            if blocks is not None:
                return blocks

    def preempt(self, req: Request, stats: SchedulerStats) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.placeholders.dropped(req)
        req.spec_token_ids = []
        req.num_preemptions += 1
        stats.num_preemptions += 1
        self.queues.enqueue(req, front=True)

    def _admit(self, b: StepBatch, stats: SchedulerStats) -> None:
        q = self.queues
        limit = self.config.max_num_seqs
        while not b.preempted and q.waiting and b.budget > 0 and len(q.running) < limit:
            req = q.waiting[0]
            hits: list[KVCacheBlock] = []
            if req.num_computed_tokens:  # its KV arrived from prefill; blocks are held
                num_hit = req.num_computed_tokens
            else:
                hits, num_hit = self.kv.get_computed_blocks(req)
                if self.remote.start_load(req, hits, num_hit):
                    continue
            n = req.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and n > b.budget:
                break
            n = min(n, b.budget)
            pad = self.spec.padding(req, n, b.budget, self.remote.is_remote(req))
            if self.kv.allocate_slots(req, n + len(pad), hits, self._ahead(req, n)) is None:
                break
            if pad:
                b.drafts[req.request_id] = pad
                b.padded.add(req.request_id)
                stats.spec_num_padded_steps += 1
                n += len(pad)
            q.waiting.popleft()
            self.remote.admitted(req, num_hit, stats)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            q.running.append(req)
            b.new.append(
                NewRequestData(
                    req.request_id,
                    req.all_token_ids(),
                    req.num_prompt_tokens,
                    req.sampling_params,
                    self.kv.block_ids(req.request_id),
                    num_hit,
                    req.eos_token_ids,
                )
            )
            b.num_tokens[req.request_id] = n
            b.budget -= n

    def _ahead(self, req: Request, num_new: int) -> int:
        """Lookahead slots to reserve past ``num_new`` tokens (never past max_model_len)."""
        room = self.max_model_len - req.num_computed_tokens - num_new
        return max(0, min(self.num_lookahead_tokens, room))
