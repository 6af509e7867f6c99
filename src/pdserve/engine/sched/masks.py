"""Structured-output bitmasks and bad-word bans: which requests of a step need them, and
when they are filled.

A request with a grammar or with bad words is counted while it lives (with none, a
step skips all of this). A grammar request that samples gets bitmask rows, one per
logits row it samples from (1 + its drafts in a verify); a request with bad words gets
the token ids banned at its sampled row.

They are filled as the step is scheduled, or, with a step in flight (in-flight depth 1)
and ``defer`` on, later: the engine core launches the step's forward, lands the step in
flight, then calls :meth:`Masks.fill` (``SchedulerOutput.masks_deferred``), so the
matchers' work overlaps the forward. ``defer`` is off where the runner cannot split a
launch (TP); a request whose next mask needs the token in flight then sits out a step
(:meth:`~pdserve.engine.sched.placeholders.Placeholders.holds_back`), or the engine
core lands that step before scheduling (:meth:`waits_for_landed_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdserve.core_types.scheduler_output import SchedulerOutput
from pdserve.engine.request import Request
from pdserve.engine.sched.placeholders import Placeholders
from pdserve.engine.structured_output import BitmaskFiller


class Masks:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.defer = True
        self.num_structured = 0  # live requests with a grammar or bad words
        self._bitmask: BitmaskFiller | None = None

    def added(self, req: Request) -> None:
        if req.needs_landed_tokens or req.bad_words:
            self.num_structured += 1

    def removed(self, req: Request) -> None:
        if req.needs_landed_tokens or req.bad_words:
            self.num_structured -= 1

    def deferring(self, depth: int) -> bool:
        """Masks are filled after the forward at this in-flight depth."""
        return depth > 0 and self.defer

    def waits_for_landed_tokens(self, running: Iterable[Request], deferring: bool) -> bool:
        """Without deferred masks, a running request's next mask needs a token in flight."""
        return self.num_structured > 0 and not deferring and Placeholders.any_mask_waiting(running)

    def plan(
        self,
        requests: Mapping[str, Request],
        scheduled: Iterable[str],
        sampling: set[str],
        deferring: bool,
    ) -> tuple[list[str], bool]:
        """(the grammar requests that sample, in batch order; whether the step's masks
        are deferred)."""
        if not self.num_structured:
            return [], False
        structured = [r for r in scheduled if r in sampling and requests[r].grammar]
        deferred = deferring and (bool(structured) or any(requests[r].bad_words for r in sampling))
        return structured, deferred

    def fill(self, so: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """Fill ``so``'s bitmask and bad-word bans from the matchers and outputs as they
        are now. Deferred, this runs after the step before ``so`` has landed; a request
        that finished on that step's token keeps a row that allows everything (what it
        samples is dropped)."""
        live = [requests.get(r) for r in so.structured_req_ids]
        if so.structured_req_ids:
            if self._bitmask is None:
                self._bitmask = BitmaskFiller(self.vocab_size)
            spec = so.scheduled_spec_decode_tokens  # a verify: a row per position
            drafts = [
                r.verified_drafts(spec.get(rid, [])) if r else list(spec.get(rid, []))
                for r, rid in zip(live, so.structured_req_ids, strict=True)
            ]
            so.grammar_bitmask = self._bitmask.fill(
                [r.grammar if r is not None and not r.is_finished else None for r in live],
                drafts if spec else None,
            )
        sampling = [requests.get(r) for r in so.num_scheduled_tokens if r in so.sampling_req_ids]
        so.bad_word_bans = {
            r.request_id: b for r in sampling if r and r.bad_words and (b := r.bad_word_bans())
        }
