"""The scheduler: decides each step how many tokens every request computes, and advances
requests by what a step produced.

It is the facade the engine core uses; the decisions live in small parts that see
counts, never tensors (:mod:`pdserve.engine.sched`): the queues and their policy,
budget/admission/preemption, remote KV, speculation and padding, in-flight accounting
(``Placeholders``: depth 0 synchronous, 1 asynchronous), masks and stops.

A step (:meth:`Scheduler.schedule`): free what the KV connector released, choose the
step's draft count, walk the running then the waiting requests under the token budget,
then every request whose step reaches the end of its tokens samples (its drafts plus one
token count as in flight until the step lands) and the masks are planned. A landed step
(:meth:`Scheduler.update_from_output`): the connector's report, prompt logprobs, then per
sampling row the accepted tokens up to a stop, the rejected drafts' slots given back,
the acceptance counted and the next drafts recorded.

A request with ``prompt_logprobs`` gets no prefix-cache hits (every prompt position's
logits are needed, as in vLLM); its blocks are still committed for others. The runner
scores each prefill chunk's positions, the chunks accumulate on the request by position
(a chunk recomputed after a preemption rewrites the same values) and go out whole with
its first token.

Every per-step collection (finished ids) is handed out and replaced each step, so
nothing grows with the number of requests served.
"""

from __future__ import annotations

import time
from collections import deque

from pdserve.config import SchedulerConfig
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.scheduler_output import EngineCoreOutput, RunnerOutput, SchedulerOutput
from pdserve.core_types.stats import SchedulerStats
from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sched.admission import Admission
from pdserve.engine.sched.masks import Masks
from pdserve.engine.sched.placeholders import Placeholders
from pdserve.engine.sched.queues import Queues
from pdserve.engine.sched.remote_kv import RemoteKV
from pdserve.engine.sched.spec import SpecSchedule
from pdserve.engine.sched.stops import take_tokens
from pdserve.kv_transfer.base import KVConnectorScheduler
from pdserve.spec_decode.draft_policy import DraftPolicy


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        connector: KVConnectorScheduler | None = None,
        load_failure_policy: str = "fail",
        num_spec_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        pad_first_step: bool = False,
        vocab_size: int = 0,
        draft_policy: DraftPolicy | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.connector = connector
        self.num_spec_tokens = num_spec_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.queues = Queues(config.scheduling_policy)
        self.inflight = Placeholders(int(config.async_scheduling), max_model_len)
        self.spec = SpecSchedule(num_spec_tokens, max_model_len, pad_first_step, draft_policy)
        self.remote = RemoteKV(connector, load_failure_policy, kv, self.queues)
        self.masks = Masks(vocab_size)
        self.admission = Admission(
            config,
            kv,
            self.queues,
            self.inflight,
            self.spec,
            self.remote,
            max_model_len,
            num_lookahead_tokens,
        )
        self._finished_ids: set[str] = set()

    # -- the parts' state, as the engine and its tools read it ------------------------------
    @property
    def waiting(self) -> deque[Request]:
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    @property
    def waiting_remote(self) -> dict[str, Request]:
        """Requests in WAITING_FOR_REMOTE_KV."""
        return self.remote.waiting

    @property
    def async_scheduling(self) -> bool:
        """One step in flight when the next is scheduled (in-flight depth 1)."""
        return self.inflight.depth == 1

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        if int(on) != self.inflight.depth and any(r.num_output_placeholders for r in self.running):
            raise RuntimeError("the scheduling mode changes only with no step in flight")
        self.inflight.depth = int(on)

    @property
    def defer_masks(self) -> bool:
        """Fill masks after the step's forward is launched, with a step in flight (the
        engine core turns it off where the runner cannot split a launch: TP)."""
        return self.masks.defer

    @defer_masks.setter
    def defer_masks(self, on: bool) -> None:
        self.masks.defer = on

    @property
    def deferring_masks(self) -> bool:
        return self.masks.deferring(self.inflight.depth)

    # -- request lifecycle -----------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.remote.on_new_request(req)
        self.requests[req.request_id] = req
        self.queues.enqueue(req, front=False)
        self.masks.added(req)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop from the frontend) requests wherever they are."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self.remote.forget(req)
            else:
                self.queues.remove(req)
            self._free(req, status)
            done.append(req)
        return done

    def _free(self, req: Request, status: RequestStatus) -> KVTransferParams | None:
        """Finish ``req``; its blocks are freed now unless the connector takes them over
        (prefill holding them for decode). Returns the connector's kv_transfer_params."""
        req.status = status
        delay, params = self.remote.request_finished(req)
        req.spec_token_ids = []
        if not delay:
            self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self._finished_ids.add(req.request_id)
        self.masks.removed(req)
        return params

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def waits_for_landed_tokens(self) -> bool:
        """A running constrained request has a step in flight and its next bitmask
        needs that step's token: without deferred masks the engine core lands the step
        before scheduling."""
        return self.masks.waits_for_landed_tokens(self.running, self.deferring_masks)

    def has_schedulable_work(self) -> bool:
        """Unfinished requests other than those only waiting for remote KV."""
        return bool(self.running or self.waiting)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.remote.free_released()
        self.spec.begin_step(self.running, self.waiting, self.config.max_num_seqs, self.stats)
        deferring = self.deferring_masks
        b = self.admission.step(self.stats, masks_first=not deferring)
        will_sample: set[str] = set()
        for rid, n in b.num_tokens.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= self.inflight.end(req):
                will_sample.add(rid)
                self.spec.scheduled(req)
                self.inflight.launched(req, 1 + len(b.drafts.get(rid, ())))
        finished, self._finished_ids = self._finished_ids, set()
        structured, deferred = self.masks.plan(self.requests, b.num_tokens, will_sample, deferring)
        so = SchedulerOutput(
            scheduled_new_reqs=b.new,
            scheduled_cached_reqs=b.cached,
            num_scheduled_tokens=b.num_tokens,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - b.budget,
            scheduled_spec_decode_tokens=b.drafts,
            propose_drafts=self.spec.proposing,
            padded_spec_decode_req_ids=b.padded,
            finished_req_ids=finished,
            preempted_req_ids=b.preempted,
            sampling_req_ids=will_sample,
            kv_connector_metadata=self.remote.meta(),
            structured_req_ids=structured,
            masks_deferred=deferred,
            spec_step_shape=self.spec.step_shape(b.num_tokens, b.drafts, self.requests),
            scheduled_at=time.perf_counter(),
        )
        if self.masks.num_structured and not deferred:
            self.fill_masks(so)
        return so

    def fill_masks(self, so: SchedulerOutput) -> None:
        """Fill ``so``'s structured-output bitmask and bad-word bans (see
        :meth:`pdserve.engine.sched.masks.Masks.fill`)."""
        self.masks.fill(so, self.requests)

    def update_from_output(
        self, sched: SchedulerOutput, out: RunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if out.kv_connector_output is not None:
            for bad in self.remote.landed(out.kv_connector_output, self.stats):
                self._free(bad, RequestStatus.FINISHED_ERROR)
                outputs.append(
                    EngineCoreOutput(bad.request_id, [], finish_reason="error", error=bad.error)
                )
        if sched.is_empty:
            return outputs
        self.spec.landed(
            sched.spec_step_shape, sched.scheduled_at, time.perf_counter(), out.device_s
        )
        for rid, chunk in out.prompt_logprobs.items():
            owner = self.requests.get(rid)
            if owner is not None and owner.prompt_logprobs is not None:
                owner.prompt_logprobs.add(chunk)
        any_finished = False
        for i, rid in enumerate(out.req_ids):
            if rid not in sched.sampling_req_ids:
                continue  # a prompt chunk that did not reach the end: nothing sampled
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished, aborted or preempted since: the tokens are dropped
            eo = self._land(req, sched, out, i)
            any_finished |= eo.finish_reason is not None
            outputs.append(eo)
        if any_finished:
            self.queues.drop_finished()
        self.spec.end_step()
        self.stats.num_steps += 1
        self.stats.step_paths[out.step_path] = self.stats.step_paths.get(out.step_path, 0) + 1
        return outputs

    def _land(
        self, req: Request, sched: SchedulerOutput, out: RunnerOutput, i: int
    ) -> EngineCoreOutput:
        """Advance ``req`` by its row ``i`` of a landed step; its output."""
        rid = req.request_id
        new = out.sampled_token_ids[i]
        drafts = sched.scheduled_spec_decode_tokens.get(rid, [])
        self.inflight.landed(req, 1 + len(drafts))
        real = 0
        if drafts:
            real = self.spec.real_drafts(req, drafts, rid in sched.padded_spec_decode_req_ids)
            self.spec.observe(real, len(new) - 1)
            if len(new) < len(drafts) + 1:  # rejected drafts: their slots are recomputed
                req.num_computed_tokens -= len(drafts) + 1 - len(new)
                self.kv.trim(rid, req.num_computed_tokens + self.num_lookahead_tokens)
        status, taken = take_tokens(req, new, self.max_model_len)
        if real:  # drafts accepted past a stop were of no use
            self.spec.count(self.stats, real, taken - 1)
        self.stats.num_generated_tokens += taken
        lp = None
        if out.logprobs is not None and req.sampling_params.logprobs is not None:
            lp = out.logprobs[i][:taken]
        eo = EngineCoreOutput(rid, new[:taken], lp, num_cached_tokens=req.num_cached_tokens)
        ntop = req.sampling_params.logprobs
        if ntop and out.top_token_ids is not None and out.top_logprobs is not None:
            eo.new_top_token_ids = [t[:ntop] for t in out.top_token_ids[i][:taken]]
            eo.new_top_logprobs = [t[:ntop] for t in out.top_logprobs[i][:taken]]
        if req.prompt_logprobs is not None:  # the first token: the prompt is complete
            eo.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs.take(), None
        if status is not None:
            eo.finish_reason = status.finish_reason
            eo.stop_reason = req.stop_reason
            eo.error = req.error if status == RequestStatus.FINISHED_ERROR else None
            eo.kv_transfer_params = self._free(req, status)
        elif self.num_spec_tokens:  # none when the step proposed none
            req.spec_token_ids = out.draft_token_ids[i] if out.draft_token_ids is not None else []
        return eo

    def make_stats(self) -> SchedulerStats:
        s = self.stats
        s.num_running_reqs = len(self.running)
        s.num_waiting_reqs = len(self.waiting)
        s.kv_cache_usage = self.kv.usage()
        s.prefix_cache_queries = self.kv.prefix_queries
        s.prefix_cache_hits = self.kv.prefix_hits
        self.remote.fill_stats(s)
        return s
