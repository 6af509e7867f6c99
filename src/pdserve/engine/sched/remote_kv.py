"""Prompts whose KV comes from a prefill instance (the scheduler's side of the KV
connector), and where every admitted prompt's tokens came from.

When the waiting queue's head has tokens the connector can pull, its blocks are
allocated (kept out of the prefix cache until the KV arrives) and it is parked in
WAITING_FOR_REMOTE_KV: it takes no running slot and no token budget while the pull is in
flight. Lookahead slots are not reserved then, only once it runs. A pull that finished
puts it back at the waiting queue's front with those tokens computed (the last prompt
token is recomputed, for its logits); a failed pull follows the load-failure policy:
``recompute`` (prefilled locally, from the front of the queue) or ``fail`` (the request
ends with an error that names the cause).

At a request's first admission its prompt tokens are counted by source: local prefix
cache hits, external KV transfer, local compute.
"""

from __future__ import annotations

from pdserve.core_types.kv_connector import (
    KV_LOAD_FAILED,
    KVConnectorMetadata,
    KVConnectorOutput,
)
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.stats import SchedulerStats
from pdserve.engine.kv_cache.block_pool import KVCacheBlock
from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sched.queues import Queues
from pdserve.kv_transfer.base import KVConnectorScheduler


class RemoteKV:
    def __init__(
        self,
        connector: KVConnectorScheduler | None,
        load_failure_policy: str,
        kv: KVCacheManager,
        queues: Queues,
    ) -> None:
        self.connector = connector
        self.load_failure_policy = load_failure_policy
        self.kv = kv
        self.queues = queues
        # WAITING_FOR_REMOTE_KV: blocks allocated, pull in flight, no running slot taken
        self.waiting: dict[str, Request] = {}
        self._tokens: dict[str, tuple[int, int]] = {}  # id -> (local hits, external)

    def on_new_request(self, req: Request) -> None:
        if self.connector is not None:
            self.connector.on_new_request(req)

    def free_released(self) -> None:
        """Free the blocks the connector held and no longer needs."""
        if self.connector is not None:
            for rid in self.connector.take_freeable():
                self.kv.free(rid)

    def start_load(self, req: Request, hits: list[KVCacheBlock], num_hit: int) -> bool:
        """Park ``req``, the waiting queue's head, if its prompt comes from a prefill
        instance. Returns True when it was taken off the queue."""
        if self.connector is None:
            return False
        num_ext, _ = self.connector.get_num_new_matched_tokens(req, num_hit)
        if num_ext <= 0:
            return False
        if self.kv.allocate_slots(req, num_ext, hits, commit=False) is None:
            return False  # no room: it is admitted like any request once blocks free up
        self.queues.waiting.popleft()
        self.kv.record_lookup(req.num_tokens, num_hit)
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting[req.request_id] = req
        self._tokens[req.request_id] = (num_hit, num_ext)
        self.connector.update_state_after_alloc(req, self.kv.block_ids(req.request_id), num_ext)
        return True

    def is_remote(self, req: Request) -> bool:
        """``req``'s prompt KV came from a prefill instance (not yet admitted since)."""
        return self._tokens.get(req.request_id, (0, 0))[1] > 0

    def admitted(self, req: Request, num_hit: int, stats: SchedulerStats) -> None:
        """``req`` runs, with ``num_hit`` tokens computed: count its prefix lookup (a
        parked prompt's was counted when it was parked) and, the first time, its
        prompt's sources."""
        if req.request_id not in self._tokens:
            self.kv.record_lookup(req.num_tokens, num_hit)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
            local_hit, external = self._tokens.pop(req.request_id, (num_hit, 0))
            src = stats.prompt_tokens_by_source
            src["local_cache_hit"] += local_hit
            src["external_kv_transfer"] += external
            src["local_compute"] += req.num_prompt_tokens - local_hit - external

    def forget(self, req: Request) -> None:
        """A parked request finished (aborted) before its pull landed."""
        del self.waiting[req.request_id]
        self._tokens.pop(req.request_id, None)

    def request_finished(self, req: Request) -> tuple[bool, KVTransferParams | None]:
        """(the connector takes over freeing the blocks, kv_transfer_params)."""
        if self.connector is None:
            return False, None
        return self.connector.request_finished(req, self.kv.block_ids(req.request_id))

    def meta(self) -> KVConnectorMetadata | None:
        return self.connector.build_connector_meta() if self.connector is not None else None

    def landed(self, out: KVConnectorOutput, stats: SchedulerStats) -> list[Request]:
        """The worker side's report: finished pulls go back to the waiting queue's front;
        failed ones follow the policy. Returns the requests to end with their error."""
        assert self.connector is not None
        self.connector.update_connector_output(out)
        for rid in out.finished_recving:
            req = self.waiting.pop(rid, None)
            if req is None:
                continue  # finished meanwhile; the connector frees its blocks
            local_hit, external = self._tokens[rid]
            req.num_computed_tokens = local_hit + external
            self.kv.commit(req, req.num_computed_tokens)
            self.queues.resume(req)
        failed = []
        for rid, why in out.failed_recving.items():
            req = self.waiting.pop(rid, None)
            if req is None:
                continue
            self._tokens.pop(rid, None)
            stats.kv_transfer_failures += 1
            self.kv.free(rid)
            self.connector.give_up(req)
            req.num_computed_tokens = 0
            if self.load_failure_policy == "recompute":
                self.queues.resume(req)  # prefilled locally from here on
            else:
                req.error = f"{KV_LOAD_FAILED}: {why}"
                failed.append(req)
        stats.kv_transfer_seconds.extend(out.transfer_seconds)
        stats.kv_transfer_bytes.extend(out.transfer_bytes)
        return failed

    def fill_stats(self, s: SchedulerStats) -> None:
        s.num_waiting_for_remote_kv = len(self.waiting)
        if self.connector is not None:
            s.kv_held_for_remote_decode = self.connector.num_held
            s.kv_leases_expired = self.connector.num_expired
