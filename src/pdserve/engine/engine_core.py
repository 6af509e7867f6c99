"""The engine core: scheduler + KV cache manager + model runner, driven one step at a time.

``step()`` is ``schedule() -> execute() -> update()`` (with async scheduling, one step
stays in flight between calls; see :meth:`EngineCore.step`). The core is single-threaded:
requests are added and aborted between steps (in-process by ``LLM``, or by the
engine-core process loop reading ZMQ messages).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from pdserve.config import EngineConfig
from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import EngineCoreOutput, SchedulerOutput
from pdserve.kv_transfer.compat import compat_info
from pdserve.kv_transfer.pd_connector import PdConnectorScheduler, make_pd_connector
from pdserve.metrics.stats import SchedulerStats, read_rss_bytes
from pdserve.runner.model_runner import ModelRunner, StepHandle

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.runner = ModelRunner(config)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        self.warmup_phases = self.runner.warm_up()
        self.kv = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.connector = self._make_connector()
        kvt = config.kv_transfer
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            self.runner.max_model_len,
            self.connector,
            kvt.kv_load_failure_policy if kvt is not None else "fail",
        )
        self._rss_read_at = 0.0
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        self.startup_seconds = time.perf_counter() - t0
        logger.info(
            "engine ready in %.2fs (weights %.2fs, warm-up %s): %d KV blocks of %d tokens on %s",
            self.startup_seconds,
            self.runner.load_seconds,
            ", ".join(f"{k} {v:.2f}s" for k, v in self.warmup_phases.items()),
            num_blocks,
            config.cache.block_size,
            self.runner.device,
        )

    def _make_connector(self) -> PdConnectorScheduler | None:
        kvt = self.config.kv_transfer
        if kvt is None:
            return None
        r = self.runner
        hc = r.hf_config
        compat = compat_info(
            model_config=dict(getattr(hc, "raw", {}) or {}),
            dtype=str(r.dtype).removeprefix("torch."),
            block_size=r.block_size,
            kv_layout=list(r.kv_caches[0].shape[2:]) if r.kv_caches else [],
            num_layers=len(r.kv_caches),
            speculative=None,
            transport=kvt.transport,
        )
        sched_half, worker_half = make_pd_connector(kvt, r.block_size, compat)
        worker_half.register_kv_caches(r.kv_caches)
        r.kv_connector = worker_half
        return sched_half

    def shutdown(self) -> None:
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.shutdown()

    def release_kv(self, request_id: str) -> bool:
        """Free blocks held for a remote decode now (the proxy gave the request up)."""
        return self.connector.release(request_id) if self.connector is not None else False

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def abort_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[EngineCoreOutput]:
        done = self.scheduler.finish_requests(request_ids, status)
        return [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason=status.finish_reason,
                num_cached_tokens=max(r.num_cached_tokens, 0),
            )
            for r in done
        ]

    def set_async_scheduling(self, on: bool) -> list[EngineCoreOutput]:
        """Switch scheduling modes between steps (benchmarks compare both on one engine).
        Leaving async mode finishes the step in flight and returns its outputs."""
        outputs: list[EngineCoreOutput] = []
        if not on and self._in_flight is not None:
            so, handle = self._in_flight
            self._in_flight = None
            outputs = self.scheduler.update_from_output(so, self.runner.finish(handle))
        self.scheduler.async_scheduling = on
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_schedulable_work(self) -> bool:
        return self.scheduler.has_schedulable_work()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and run one step; returns the outputs of the step that finished.

        With ``async_scheduling`` the step is launched and left running, and the one
        launched by the previous call is finished instead: the host schedules and
        prepares step N+1 while the device still runs step N (the scheduler counts
        N's tokens as placeholders until they land)."""
        so = self.scheduler.schedule()
        # also when empty: the runner drops finished rows and the connector reports
        if not self.scheduler.async_scheduling:
            return self.scheduler.update_from_output(so, self.runner.execute_model(so))
        handle = self.runner.launch(so)
        prev, self._in_flight = self._in_flight, (so, handle)
        if prev is None:
            return []
        return self.scheduler.update_from_output(prev[0], self.runner.finish(prev[1]))

    def stats(self) -> SchedulerStats:
        s = self.scheduler.make_stats()
        # transfers are reported once: the snapshot takes the lists, the scheduler starts anew
        self.scheduler.stats = replace(s, kv_transfer_seconds=[], kv_transfer_bytes=[])
        now = time.monotonic()
        if now - self._rss_read_at > 1.0:  # /proc read at most once a second
            s.process_rss_bytes["engine_core"] = read_rss_bytes()
            self._rss_read_at = now
        return s
