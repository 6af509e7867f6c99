"""The scheduler: decides each step how many tokens every request computes.

Policy: running requests first (in arrival order), each gets what it still needs up
to the step's token budget; when blocks run out the most recently admitted running
request is preempted (recompute: its blocks are freed and it re-enters the front of
the waiting queue). Waiting requests are admitted in FIFO order while the token
budget, ``max_num_seqs`` and free blocks allow, prompts chunked to fit the budget.
No new requests are admitted in a step that preempted.

With ``--scheduling-policy priority`` the waiting queue is ordered by (priority, arrival)
(lower priority value first, as vLLM) and the preemption victim is the running request
with the highest (priority, arrival) among those not yet scheduled in the step; a
waiting request does not preempt running ones to get in.

Speculative decoding (``num_spec_tokens`` > 0; :mod:`pdserve.engine.spec_schedule`): a
decoding request computes its last token plus up to the step's draft count (``k``, or
the adaptive policy's choice for the batch), capped so that its positions stay within ``max_model_len``
but not by its ``max_tokens`` (tokens accepted past it are dropped; a shorter verify
near the end would break the batch's uniform 1+k shape and its CUDA graph). The drafts are the ones the last finished step
proposed (``Request.spec_token_ids``), or, under async scheduling while a step of the
request is still in flight, ``-1`` placeholders the runner fills on the device. When
the result lands the request advances by however many tokens were accepted; stops and
length limits are checked token by token inside that run, and the slots of rejected
drafts are given back. A request still short of ``min_tokens`` gets no drafts (its
bans need an exact output count).

MTP drafting writes the draft layer's KV up to k positions past a step, so with
``num_lookahead_tokens`` every allocation reserves that many slots beyond the step
(capped at ``max_model_len``) and trimming keeps them. On a P/D decode instance a
request's first step (its last prompt token, recomputed after the KV pull) carries no
drafts; with ``pad_first_step`` it verifies k ``-1`` placeholders instead, so that step
is the same (1+k)-token shape as every other decode (``padded_spec_decode_req_ids``;
placeholders are never accepted and are left out of the acceptance counts). Lookahead
slots are not reserved while a KV pull is in flight, only once the request runs.

A request with ``prompt_logprobs`` gets no prefix-cache hits (every prompt position's
logits are needed, as in vLLM); its blocks are still committed for others. The runner
scores each prefill chunk's positions, the chunks accumulate on the request by position
(a chunk recomputed after a preemption rewrites the same values) and go out whole with
its first token.

Every per-step collection (finished ids) is handed out and replaced each step, so
nothing grows with the number of requests served.
"""

from __future__ import annotations

from collections import deque

from pdserve.config import SchedulerConfig
from pdserve.core_types.kv_connector import KV_LOAD_FAILED, KVConnectorOutput
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
)
from pdserve.core_types.stats import SchedulerStats
from pdserve.engine.kv_cache.block_pool import KVCacheBlock
from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.spec_schedule import SpecSchedule
from pdserve.engine.structured_output import BitmaskFiller
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
        self.load_failure_policy = load_failure_policy
        self.async_scheduling = config.async_scheduling
        # under async scheduling, fill structured-output masks after the step's forward
        # is launched (the engine core lands the step before, then calls fill_masks);
        # the engine core turns it off where the runner cannot split a launch (TP)
        self.defer_masks = True
        self.priority_policy = config.scheduling_policy == "priority"
        self.num_spec_tokens = num_spec_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec = SpecSchedule(num_spec_tokens, max_model_len, pad_first_step, draft_policy)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # WAITING_FOR_REMOTE_KV: blocks allocated, pull in flight, no running slot taken
        self.waiting_remote: dict[str, Request] = {}
        self._remote_tokens: dict[str, tuple[int, int]] = {}  # id -> (local hits, external)
        self._finished_ids: set[str] = set()
        self.stats = SchedulerStats()
        self.vocab_size = vocab_size
        self.num_structured = 0  # requests with a grammar (structured output) or bad words
        self._bitmask: BitmaskFiller | None = None

    # -- request lifecycle -----------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if self.connector is not None:
            self.connector.on_new_request(req)
        self.requests[req.request_id] = req
        self._enqueue(req, front=False)
        if req.needs_landed_tokens or req.bad_words:
            self.num_structured += 1

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop from the frontend) requests wherever they are."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                del self.waiting_remote[req.request_id]
                self._remote_tokens.pop(req.request_id, None)
            else:
                self.waiting.remove(req)
            self._free(req, status)
            done.append(req)
        return done

    def _free(self, req: Request, status: RequestStatus) -> KVTransferParams | None:
        """Finish ``req``; its blocks are freed now unless the connector takes them over
        (prefill holding them for decode). Returns the connector's kv_transfer_params."""
        req.status = status
        delay, params = False, None
        if self.connector is not None:
            delay, params = self.connector.request_finished(req, self.kv.block_ids(req.request_id))
        req.spec_token_ids = []
        if not delay:
            self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self._finished_ids.add(req.request_id)
        if req.needs_landed_tokens or req.bad_words:
            self.num_structured -= 1
        return params

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # a token in flight for it is dropped
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._enqueue(req, front=True)

    def _enqueue(self, req: Request, front: bool) -> None:
        """Into the waiting queue: fcfs at the back (``front``: at the front, where a
        preempted or KV-loaded request resumes); priority by (priority, arrival)."""
        if not self.priority_policy:
            if front:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
            return
        key = (req.priority, req.arrival_time)
        for j, other in enumerate(self.waiting):
            if key < (other.priority, other.arrival_time):
                self.waiting.insert(j, req)
                return
        self.waiting.append(req)

    def _victim(self, first: int) -> Request:
        """The running request to preempt among those not scheduled yet this step
        (``running[first:]``): the latest admitted (fcfs) or the lowest priority, latest
        arrival first (priority)."""
        if not self.priority_policy:
            return self.running.pop()
        j = max(
            range(first, len(self.running)),
            key=lambda k: (self.running[k].priority, self.running[k].arrival_time),
        )
        return self.running.pop(j)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def deferring_masks(self) -> bool:
        return self.async_scheduling and self.defer_masks

    def waits_for_landed_tokens(self) -> bool:
        """A running constrained request has a step in flight and its next bitmask
        needs that step's token: without deferred masks the engine core lands the step
        before scheduling."""
        return (
            self.num_structured > 0
            and not self.deferring_masks
            and any(r.num_output_placeholders and r.needs_landed_tokens for r in self.running)
        )

    def has_schedulable_work(self) -> bool:
        """Unfinished requests other than those only waiting for remote KV."""
        return bool(self.running or self.waiting)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.connector is not None:
            for rid in self.connector.take_freeable():
                self.kv.free(rid)
        budget = self.config.max_num_batched_tokens
        self.spec.begin_step(self.running, self.waiting, self.config.max_num_seqs, self.stats)
        num_sched: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()

        spec: dict[str, list[int]] = {}
        padded: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_output_placeholders and (
                (req.needs_landed_tokens and not self.deferring_masks) or self._reaches_length(req)
            ):
                # its last token is in flight: it finishes when that lands, or (structured
                # output without deferred masks) its matcher needs that token first
                i += 1
                continue
            n = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens, budget)
            drafts = self.spec.drafts(req, n, budget) if self.num_spec_tokens else None
            if drafts:
                n += len(drafts)
            blocks = None
            while True:
                blocks = self.kv.allocate_slots(req, n, num_lookahead_tokens=self._ahead(req, n))
                if blocks is not None:
                    break
                victim = self._victim(i)  # never one already scheduled this step
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            if blocks is None:
                break
            num_sched[req.request_id] = n
            if drafts:
                spec[req.request_id] = drafts
            cached_reqs.append(
                CachedRequestData(
                    req.request_id,
                    [b.block_id for b in blocks],
                    self.kv.num_blocks(req.request_id),
                    req.num_computed_tokens,
                )
            )
            budget -= n
            i += 1

        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            hits: list[KVCacheBlock] = []
            if req.num_computed_tokens:  # its KV arrived from prefill; blocks are held
                num_hit = req.num_computed_tokens
            else:
                hits, num_hit = self.kv.get_computed_blocks(req)
                if self._start_remote_load(req, hits, num_hit):
                    continue
            n = req.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            remote = self._remote_tokens.get(req.request_id, (0, 0))[1] > 0
            pad = self.spec.padding(req, n, budget, remote)
            if self.kv.allocate_slots(req, n + len(pad), hits, self._ahead(req, n)) is None:
                break
            if pad:
                spec[req.request_id] = pad
                padded.add(req.request_id)
                self.stats.spec_num_padded_steps += 1
                n += len(pad)
            self.waiting.popleft()
            if req.request_id not in self._remote_tokens:  # a pulled prompt's was, parked
                self.kv.record_lookup(req.num_tokens, num_hit)
            if req.num_cached_tokens < 0:  # first admission: account the prompt's sources
                req.num_cached_tokens = num_hit
                local_hit, external = self._remote_tokens.pop(req.request_id, (num_hit, 0))
                src = self.stats.prompt_tokens_by_source
                src["local_cache_hit"] += local_hit
                src["external_kv_transfer"] += external
                src["local_compute"] += req.num_prompt_tokens - local_hit - external
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self.running.append(req)
            new_reqs.append(
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
            num_sched[req.request_id] = n
            budget -= n

        will_sample: set[str] = set()
        for rid, n in num_sched.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
                will_sample.add(rid)
                self.spec.scheduled(req)
                if self.async_scheduling:
                    req.num_output_placeholders += 1 + len(spec.get(rid, ()))
        finished, self._finished_ids = self._finished_ids, set()
        structured: list[str] = []
        deferred = False
        if self.num_structured:
            structured = [r for r in num_sched if r in will_sample and self.requests[r].grammar]
            deferred = self.deferring_masks and (
                bool(structured) or any(self.requests[r].bad_words for r in will_sample)
            )
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_sched,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            scheduled_spec_decode_tokens=spec,
            propose_drafts=self.spec.proposing,
            padded_spec_decode_req_ids=padded,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            sampling_req_ids=will_sample,
            kv_connector_metadata=(
                self.connector.build_connector_meta() if self.connector is not None else None
            ),
            structured_req_ids=structured,
            masks_deferred=deferred,
        )
        if self.num_structured and not deferred:
            self.fill_masks(so)
        return so

    def fill_masks(self, so: SchedulerOutput) -> None:
        """Fill ``so``'s structured-output bitmask and bad-word bans from the matchers
        and outputs as they are now. With deferred masks this runs after the step before
        ``so`` has landed; a request that finished on that step's token keeps a row
        that allows everything (what it samples is dropped)."""
        live = [self.requests.get(r) for r in so.structured_req_ids]
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
        sampling = [
            self.requests.get(r) for r in so.num_scheduled_tokens if r in so.sampling_req_ids
        ]
        so.bad_word_bans = {
            r.request_id: b for r in sampling if r and r.bad_words and (b := r.bad_word_bans())
        }

    def _ahead(self, req: Request, num_new: int) -> int:
        """Lookahead slots to reserve past ``num_new`` tokens (never past max_model_len)."""
        room = self.max_model_len - req.num_computed_tokens - num_new
        return max(0, min(self.num_lookahead_tokens, room))

    def _start_remote_load(self, req: Request, hits: list[KVCacheBlock], num_hit: int) -> bool:
        """Park ``req`` in WAITING_FOR_REMOTE_KV if its prompt comes from a prefill
        instance. Returns True when the waiting queue's head was consumed."""
        if self.connector is None:
            return False
        num_ext, _ = self.connector.get_num_new_matched_tokens(req, num_hit)
        if num_ext <= 0:
            return False
        if self.kv.allocate_slots(req, num_ext, hits, commit=False) is None:
            return False  # no room: it is admitted like any request once blocks free up
        self.waiting.popleft()
        self.kv.record_lookup(req.num_tokens, num_hit)
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_remote[req.request_id] = req
        self._remote_tokens[req.request_id] = (num_hit, num_ext)
        self.connector.update_state_after_alloc(req, self.kv.block_ids(req.request_id), num_ext)
        return True

    def _on_connector_output(self, out: KVConnectorOutput) -> list[EngineCoreOutput]:
        """Loads that finished return to the waiting queue's front; failed ones follow
        the load-failure policy."""
        assert self.connector is not None
        self.connector.update_connector_output(out)
        outputs: list[EngineCoreOutput] = []
        for rid in out.finished_recving:
            req = self.waiting_remote.pop(rid, None)
            if req is None:
                continue  # finished meanwhile; the connector frees its blocks
            local_hit, external = self._remote_tokens[rid]
            req.num_computed_tokens = local_hit + external
            self.kv.commit(req, req.num_computed_tokens)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        for rid, why in out.failed_recving.items():
            req = self.waiting_remote.pop(rid, None)
            if req is None:
                continue
            self._remote_tokens.pop(rid, None)
            self.stats.kv_transfer_failures += 1
            self.kv.free(rid)
            self.connector.give_up(req)
            req.num_computed_tokens = 0
            if self.load_failure_policy == "recompute":
                req.status = RequestStatus.WAITING
                self.waiting.appendleft(req)  # prefilled locally from here on
            else:
                req.error = f"{KV_LOAD_FAILED}: {why}"
                self._free(req, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(rid, [], finish_reason="error", error=req.error))
        self.stats.kv_transfer_seconds.extend(out.transfer_seconds)
        self.stats.kv_transfer_bytes.extend(out.transfer_bytes)
        return outputs

    def update_from_output(
        self, sched: SchedulerOutput, out: RunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if out.kv_connector_output is not None:
            outputs.extend(self._on_connector_output(out.kv_connector_output))
        if sched.is_empty:
            return outputs
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
            new = out.sampled_token_ids[i]
            num_drafts = len(sched.scheduled_spec_decode_tokens.get(rid, ()))
            if self.async_scheduling:
                req.num_output_placeholders -= 1 + num_drafts
            counted = num_drafts and rid not in sched.padded_spec_decode_req_ids
            real = self._num_real_drafts(req, sched, rid) if counted else 0
            if counted:
                self.spec.observe(real, len(new) - 1)
            if len(new) < num_drafts + 1:  # rejected drafts: their slots are recomputed
                req.num_computed_tokens -= num_drafts + 1 - len(new)
                self.kv.trim(rid, req.num_computed_tokens + self.num_lookahead_tokens)
            status = None
            taken = 0
            for tok in new:
                req.output_token_ids.append(tok)
                taken += 1
                status = self._stop_status(req, tok)
                if status is not None:
                    break
            if req.grammar is not None and status != RequestStatus.FINISHED_ERROR:
                status, taken = self._advance_grammar(req, new[:taken], status)
            if counted:  # drafts accepted past a stop or max_tokens were of no use
                self.spec.count(self.stats, real, taken - 1)
            lp = None
            if out.logprobs is not None and req.sampling_params.logprobs is not None:
                lp = out.logprobs[i][:taken]
            self.stats.num_generated_tokens += taken
            eo = EngineCoreOutput(rid, new[:taken], lp, num_cached_tokens=req.num_cached_tokens)
            ntop = req.sampling_params.logprobs
            if ntop and out.top_token_ids is not None and out.top_logprobs is not None:
                eo.new_top_token_ids = [t[:ntop] for t in out.top_token_ids[i][:taken]]
                eo.new_top_logprobs = [t[:ntop] for t in out.top_logprobs[i][:taken]]
            if req.prompt_logprobs is not None:  # the first token: the prompt is complete
                eo.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs.take(), None
            if status is not None:
                any_finished = True
                eo.finish_reason = status.finish_reason
                eo.stop_reason = req.stop_reason
                eo.error = req.error if status == RequestStatus.FINISHED_ERROR else None
                eo.kv_transfer_params = self._free(req, status)
            elif self.num_spec_tokens:  # none when the step proposed none
                req.spec_token_ids = (
                    out.draft_token_ids[i] if out.draft_token_ids is not None else []
                )
            outputs.append(eo)
        if any_finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        self.spec.end_step()
        self.stats.num_steps += 1
        self.stats.step_paths[out.step_path] = self.stats.step_paths.get(out.step_path, 0) + 1
        return outputs

    @staticmethod
    def _num_real_drafts(req: Request, sched: SchedulerOutput, rid: str) -> int:
        """Drafts a verify actually had (placeholders as the device filled them)."""
        return sum(d >= 0 for d in req.verified_drafts(sched.scheduled_spec_decode_tokens[rid]))

    def _reaches_length(self, req: Request) -> bool:
        """True when the tokens in flight already take ``req`` to its length limit."""
        n_out = req.num_output_tokens + req.num_output_placeholders
        return n_out >= req.max_output_tokens or (
            req.num_tokens + req.num_output_placeholders >= self.max_model_len
        )

    @staticmethod
    def _advance_grammar(
        req: Request, tokens: list[int], status: RequestStatus | None
    ) -> tuple[RequestStatus | None, int]:
        """Feed the accepted tokens to the request's matcher: it stops once the grammar
        terminates (tokens a verify accepted after that are dropped); a token the grammar
        refuses (only possible when every allowed token was masked out, e.g. by
        min_tokens' bans) fails the request. Returns (status, tokens kept)."""
        assert req.grammar is not None
        used, ok = req.grammar.accept_run(tokens)
        del req.output_token_ids[len(req.output_token_ids) - len(tokens) + used :]
        if not ok:
            req.error = (
                f"token {tokens[used - 1]} does not fit the request's structured output grammar"
            )
            return RequestStatus.FINISHED_ERROR, used
        if status is None and req.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED, used
        return status, used

    def _stop_status(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_output_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def make_stats(self) -> SchedulerStats:
        s = self.stats
        s.num_running_reqs = len(self.running)
        s.num_waiting_reqs = len(self.waiting)
        s.num_waiting_for_remote_kv = len(self.waiting_remote)
        s.kv_cache_usage = self.kv.usage()
        s.prefix_cache_queries = self.kv.prefix_queries
        s.prefix_cache_hits = self.kv.prefix_hits
        if self.connector is not None:
            s.kv_held_for_remote_decode = self.connector.num_held
            s.kv_leases_expired = self.connector.num_expired
        return s
