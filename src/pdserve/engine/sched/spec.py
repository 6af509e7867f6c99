"""Speculative decoding's part of scheduling: which drafts each request verifies in a
step, the P/D first-step padding, the acceptance counts, and the step's draft count.

Per step (:meth:`SpecSchedule.begin_step`, before the scheduler walks its requests) the
step's draft count ``j`` is chosen: ``k`` with a fixed policy, else the adaptive
:class:`~pdserve.spec_decode.draft_policy.DraftPolicy`'s choice for the batch. Every
decoding request then verifies ``min(j, what it has, its room)`` drafts, so a batch keeps
the uniform ``(batch, 1 + j)`` shape of a captured graph. The cap is ``max_model_len``,
not ``max_tokens`` (drafts accepted past it are dropped; a shorter verify near the end
would break the uniform shape). A request still short of ``min_tokens`` gets no drafts
(its bans need an exact output count). The drafts are those the last landed step
proposed (``Request.spec_token_ids``) or, while a step of the request is in flight,
``-1`` placeholders the device fills from that step's proposal. A step with ``j = 0``
also proposes no drafts (``proposing``: the runner skips the drafter), so it costs what
a step without speculation costs; the next step can verify drafts again only after one
that proposed them, which a request records (``Request.drafts_in_flight``) when it is
scheduled to sample.

On a P/D decode instance a request's first step (its last prompt token, recomputed after
the KV pull) has no drafts; with ``pad_first_step`` it verifies ``j`` ``-1``
placeholders instead (:meth:`SpecSchedule.padding`), so that step has the same
``1 + j`` shape as every other decode. Placeholders are never accepted and a padded row
is left out of the acceptance counts.

When a verify lands, the request advances by the tokens accepted and the slots of
rejected drafts are given back (by the scheduler); each row's (real drafts, accepted)
goes to the policy (:meth:`observe`) and, counting only drafts up to a stop, to the
stats counters (:meth:`count`). A landed step of a uniform shape also reports what it
took to the policy (:meth:`step_shape` when scheduled, :meth:`landed` when it lands): the
device's time on it, as the runner timed it with CUDA events, or off CUDA the host's
clock from its scheduling, or the landing before it if that came later (a step in flight
behind another starts on the device when that one ends), to its landing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from pdserve.core_types.stats import SchedulerStats
from pdserve.engine.request import Request
from pdserve.spec_decode.draft_policy import DraftPolicy


class SpecSchedule:
    def __init__(
        self,
        num_spec_tokens: int,
        max_model_len: int,
        pad_first_step: bool,
        policy: DraftPolicy | None = None,
    ) -> None:
        self.k = num_spec_tokens
        self.max_model_len = max_model_len
        self.pad_first_step = pad_first_step and num_spec_tokens > 0
        self.policy = policy
        self.step_drafts = num_spec_tokens  # j of the step being scheduled
        self.proposing = num_spec_tokens > 0  # the step being scheduled runs the drafter
        self._verified: list[int] = []  # this landed step's verify rows, for the policy
        self._accepted: list[int] = []
        self._landed_at: float | None = None  # when the last step landed (perf_counter)

    def begin_step(
        self,
        running: list[Request],
        waiting: Iterable[Request],
        max_seqs: int,
        stats: SchedulerStats,
    ) -> None:
        """Choose the step's draft count for the batch it will run: the running requests
        and those it may admit (up to ``max_seqs``), at their longest context; count it."""
        if self.k <= 0:
            return
        queued = list(itertools.islice(waiting, max(0, max_seqs - len(running))))
        batch = len(running) + len(queued)
        if batch == 0:
            return
        if self.policy is not None:
            context = max(r.num_tokens for r in itertools.chain(running, queued))
            self.step_drafts = self.policy.choose(batch, context)
            self.proposing = self.step_drafts > 0
        choices = stats.spec_steps_by_num_drafts
        if len(choices) <= self.k:
            choices.extend([0] * (self.k + 1 - len(choices)))
        choices[self.step_drafts] += 1
        stats.spec_last_num_drafts = self.step_drafts

    def drafts(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The drafts ``req`` verifies this step; [] for none. Not capped by
        ``max_tokens`` (drafts past it are computed and dropped, so a request near its end
        keeps the batch's uniform shape), only by ``max_model_len``."""
        if num_new != 1 or self.step_drafts <= 0:
            return []
        if req.num_output_tokens < req.sampling_params.min_tokens:
            return []
        in_flight = req.num_output_placeholders
        if in_flight and not req.drafts_in_flight:
            return []  # the step in flight proposes none for it
        if not (in_flight or req.spec_token_ids):
            return []  # nothing proposed for it yet (its first token comes from elsewhere)
        room = self.max_model_len - req.num_tokens - in_flight
        d = min(self.step_drafts, room - 1, budget - num_new)
        if d <= 0:
            return []
        if in_flight:  # the step in flight proposes them, on the device
            return [-1] * d
        return (req.spec_token_ids + [-1] * d)[:d]

    def padding(self, req: Request, num_new: int, budget: int, remote: bool) -> list[int]:
        """Placeholder drafts for a P/D decode's first step (``remote``: its prompt KV came
        from a prefill instance), [] for none."""
        if not (self.pad_first_step and req.num_output_tokens == 0 and num_new == 1 and remote):
            return []
        j = self.step_drafts
        if j <= 0 or self.max_model_len - req.num_tokens < 1 + j or budget < 1 + j:
            return []  # a shorter verify would not be the uniform shape anyway
        return [-1] * j

    def step_shape(
        self, num_tokens: dict[str, int], drafts: dict[str, list[int]], requests: dict[str, Request]
    ) -> tuple[int, int, int] | None:
        """(batch, longest context, j) of a step whose every request verifies ``j`` drafts
        (and that proposes drafts iff ``j > 0``): the shapes the policy weighs; else
        None (prompt chunks, a step between ``j = 0`` and drafting, no adaptive policy)."""
        if self.policy is None or not num_tokens:
            return None
        j = self.step_drafts if self.proposing else 0
        for rid, n in num_tokens.items():
            if n != 1 + j or len(drafts.get(rid, ())) != j:
                return None
        return len(num_tokens), max(requests[rid].num_tokens for rid in num_tokens), j

    def landed(
        self,
        shape: tuple[int, int, int] | None,
        scheduled_at: float,
        now: float,
        device_s: float | None = None,
    ) -> None:
        """A step landed at ``now``: what it took goes to the policy (uniform shapes), the
        device's time where the runner measured it (CUDA), else the host's clock."""
        before, self._landed_at = self._landed_at, now
        if self.policy is None or shape is None:
            return
        if device_s is None:
            device_s = now - (scheduled_at if before is None else max(before, scheduled_at))
        self.policy.observe_cost(*shape, device_s)

    def scheduled(self, req: Request) -> None:
        """``req`` samples in the step being scheduled: whether that step drafts for it."""
        req.drafts_in_flight = self.proposing

    @staticmethod
    def real_drafts(req: Request, scheduled: list[int], padded: bool) -> int:
        """Drafts a landed verify really had (placeholders as the device filled them; none
        in a padded first step)."""
        if padded:
            return 0
        return sum(d >= 0 for d in req.verified_drafts(scheduled))

    def observe(self, real_drafts: int, accepted: int) -> None:
        """A landed verify row: its real drafts and how many the sampler accepted."""
        if self.policy is not None and real_drafts > 0:
            self._verified.append(real_drafts)
            self._accepted.append(min(accepted, real_drafts))

    def end_step(self) -> None:
        """A landed step's rows go to the policy as one observation."""
        if self.policy is not None and self._verified:
            self.policy.observe(self._verified, self._accepted)
            self._verified, self._accepted = [], []

    @staticmethod
    def count(stats: SchedulerStats, num_drafts: int, num_accepted: int) -> None:
        """The acceptance counters of one verify row (drafts used up to a stop)."""
        if num_drafts <= 0:
            return
        stats.spec_num_drafts += 1
        stats.spec_num_draft_tokens += num_drafts
        stats.spec_num_accepted_tokens += num_accepted
        per_pos = stats.spec_num_accepted_tokens_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1
