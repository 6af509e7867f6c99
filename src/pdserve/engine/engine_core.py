"""The engine core: scheduler + KV cache manager + model runner, driven one step at a time.

``step()`` is ``schedule()``, then the runner's step pipeline
(:mod:`pdserve.runner.step_pipeline`), whose land phase hands finished steps to the
scheduler's ``update_from_output``; with async scheduling (pipeline depth 1) one step
stays in flight between calls. The core is single-threaded:
requests are added and aborted between steps (in-process by ``LLM``, or by the
engine-core process loop reading ZMQ messages). The KV connector's worker half is
driven here, around the runner: it starts the step's loads before the step launches
and reports what finished when the step's results are collected.

Data parallelism: one engine core per DP rank (its own process, scheduler, KV pool,
runner and KV connector; ``groups`` says which rank). Under expert parallelism
(``dp_sync`` set) every :meth:`EngineCore.step` runs the DP step agreement between
scheduling and launching, exactly once, whatever the step holds; ``wake_seq`` (set by
the process loop from the client's wake messages) and ``last_plan`` feed the loop's
decision to wait on its socket (:mod:`pdserve.distributed.dp_sync`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from pdserve.config import EngineConfig
from pdserve.core_types.messages import EngineCoreRequest
from pdserve.core_types.scheduler_output import EngineCoreOutput, RunnerOutput, SchedulerOutput
from pdserve.core_types.stats import SchedulerStats, read_rss_bytes
from pdserve.distributed.dp_sync import DPStepSync, LocalStep, StepPlan
from pdserve.distributed.groups import ParallelGroups
from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.structured_output import StructuredOutputManager
from pdserve.engine.tp_workers import TPLeader, start_runner
from pdserve.kv_transfer.base import KVConnectorWorker, KVHealth
from pdserve.kv_transfer.compat import compat_info
from pdserve.kv_transfer.pd_connector import (
    PdConnectorScheduler,
    make_pd_connector,
    require_secret,
)
from pdserve.runner.model_runner import ModelRunner
from pdserve.runner.model_step import kv_cache_scales
from pdserve.runner.step_pipeline import StepPipeline
from pdserve.spec_decode.draft_policy import DraftPolicy
from pdserve.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)
_SUPERVISE_EVERY_S = 0.1
_COMPILE_WAIT_S = 0.005  # an idle step waits this long for a grammar being compiled


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        proposer: Proposer | None = None,
        groups: ParallelGroups | None = None,
    ) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.groups = groups if groups is not None else ParallelGroups()
        dp = config.parallel.data_parallel_size
        if self.groups.dp.size != dp:
            raise ValueError(
                f"--data-parallel-size {dp} needs one engine-core process per rank, joined "
                "in a process group: run it with `pdserve serve` (the in-process LLM runs "
                "one rank)"
            )
        self.dp_rank = self.groups.info.dp_rank
        if config.kv_transfer is not None:
            require_secret()  # before the weights load: a P/D role without it cannot run
        self.kv_health = KVHealth()
        self._supervised_at = 0.0
        # tensor parallelism: this process is rank 0 and drives the other ranks' runners
        self.tp: TPLeader | None = None
        if config.parallel.tensor_parallel_size > 1:
            if proposer is not None:
                raise ValueError("a custom proposer cannot be used with --tensor-parallel-size > 1")
            self.tp = TPLeader(config)
        try:
            self.runner = self._start_runner(proposer)
        except BaseException:
            if self.tp is not None:
                self.tp.shutdown()
            raise
        num_blocks = self.runner.num_blocks
        self.dp_sync = DPStepSync(self.groups.dp) if self.runner.lockstep else None
        if config.parallel.enable_expert_parallel and self.dp_sync is None:
            logger.warning(
                "--enable-expert-parallel has no effect here (%s): experts are spread over "
                "the data-parallel ranks of a model with MoE layers",
                "--data-parallel-size is 1" if dp == 1 else "the model has no MoE layers",
            )
        self.wake_seq = 0  # the highest client wake message read (expert parallelism)
        self.stopping = False  # Shutdown read: the ranks leave together after a step
        self.last_plan: StepPlan | None = None
        self.kv = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.connector_worker: KVConnectorWorker | None = None
        self.connector = self._make_connector()
        kvt = config.kv_transfer
        spec = config.speculative
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            self.runner.max_model_len,
            self.connector,
            kvt.kv_load_failure_policy if kvt is not None else "fail",
            num_spec_tokens=self.runner.num_spec,
            num_lookahead_tokens=self.runner.lookahead,
            pad_first_step=spec.pad_first_decode_step if spec is not None else False,
            vocab_size=self.runner.vocab_size,
            draft_policy=self._draft_policy(),
        )
        # a TP step is launched whole on every rank: its masks are filled before it
        self.scheduler.defer_masks = self.tp is None
        self.structured = StructuredOutputManager(
            config.model.tokenizer or config.model.model, self.runner.vocab_size
        )
        self._rss_read_at = 0.0
        self.pipeline = StepPipeline(self.runner)
        self.pipeline.depth = 1 if config.scheduler.async_scheduling else 0
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

    def _draft_policy(self) -> DraftPolicy | None:
        """The adaptive draft count, where the runner allows it and timed its graphs."""
        r = self.runner
        if not (r.adaptive_drafts and r.step_costs):
            return None
        policy = DraftPolicy(r.num_spec)
        policy.set_costs(r.step_costs)
        return policy

    def _start_runner(self, proposer: Proposer | None) -> ModelRunner:
        """Build this rank's runner, agree on the KV blocks with the other ranks (if any),
        allocate and warm up."""
        if self.tp is None:
            runner = ModelRunner(self.config, proposer, groups=self.groups)
            _, self.warmup_phases = start_runner(runner, runner.groups.tp)
            return runner
        with self.tp.collective():
            runner = ModelRunner(self.tp.config, groups=self.tp.groups)
            _, self.warmup_phases = start_runner(runner, self.tp.groups.tp)
        self.tp.serving = True
        return runner

    def _make_connector(self) -> PdConnectorScheduler | None:
        kvt = self.config.kv_transfer
        if kvt is None:
            return None
        port = int(kvt.kv_connector_extra_config.get("port", 0))
        if port and self.dp_rank:  # each DP rank serves its own blocks: ports port + dp_rank
            extra = {**kvt.kv_connector_extra_config, "port": port + self.dp_rank}
            kvt = replace(kvt, kv_connector_extra_config=extra)
        r = self.runner
        compat = compat_info(
            model_config=dict(getattr(r.hf_config, "raw", {}) or {}),
            kv_cache=r.kv_cache_config.describe(),
            block_size=r.block_size,
            speculative=self.config.speculative.describe() if self.config.speculative else None,
            transport=kvt.transport,
            kv_cache_scales=kv_cache_scales(r.kv_cache_config, r.step.group_layers),
        )
        sched_half, worker_half = make_pd_connector(kvt, r.block_size, compat)
        worker_half.register_kv_caches(r.kv_caches)
        self.connector_worker = worker_half
        return sched_half

    def shutdown(self) -> None:
        self.structured.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.tp is not None:
            self.tp.shutdown()

    def release_kv(self, request_id: str) -> bool:
        """Free blocks held for a remote decode now (the proxy gave the request up)."""
        return self.connector.release(request_id) if self.connector is not None else False

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the frontend validated (a duplicate id is a ValueError). A
        constrained one waits for its grammar first (compiled off the step loop)."""
        req = Request(request)
        if req.sampling_params.structured_outputs is None:
            self.scheduler.add_request(req)
            return
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.structured.add(req)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Queue the constrained requests whose grammar is ready; fail those whose
        grammar did not compile."""
        if not self.structured.pending:
            return []
        idle = not self.scheduler.has_schedulable_work()
        ready, failed = self.structured.take_ready(wait_s=_COMPILE_WAIT_S if idle else 0.0)
        for req in ready:
            self.scheduler.add_request(req)
        return [
            EngineCoreOutput(req.request_id, [], finish_reason="error", error=why)
            for req, why in failed
        ]

    def abort_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[EngineCoreOutput]:
        done = self.scheduler.finish_requests(request_ids, status)
        for rid in request_ids:
            waiting = self.structured.abort(rid)
            if waiting is not None:
                waiting.status = status
                done.append(waiting)
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
        outputs = [] if on else self.pipeline.drain(self._land)
        self.scheduler.async_scheduling = on
        self.pipeline.depth = 1 if on else 0
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.structured.pending)

    def has_schedulable_work(self) -> bool:
        return self.scheduler.has_schedulable_work() or bool(self.structured.pending)

    def _begin(self, so: SchedulerOutput) -> StepPlan | None:
        """What precedes every launch: the DP agreement and the connector's loads."""
        plan = self._agree(so)
        if self.connector_worker is not None and so.kv_connector_metadata is not None:
            self.connector_worker.start_load_kv(so.kv_connector_metadata)
        return plan

    def _masks(self, so: SchedulerOutput) -> None:
        """The pipeline's masks phase: masks the scheduler left until the step before
        landed (its tokens advance the matchers) are filled now."""
        if so.masks_deferred:
            self.scheduler.fill_masks(so)

    def _agree(self, so: SchedulerOutput) -> StepPlan | None:
        """The DP step agreement (expert parallelism only; a collective, see dp_sync)."""
        if self.dp_sync is None:
            return None
        counts = set(so.num_scheduled_tokens.values())
        local = LocalStep(
            num_tokens=so.total_num_scheduled_tokens,
            num_reqs=len(so.num_scheduled_tokens),
            uniform_q=counts.pop() if len(counts) == 1 else None,
            pending=self.has_unfinished_requests(),
            wake_seq=self.wake_seq,
            stopping=self.stopping,
        )
        self.last_plan = self.dp_sync.agree(local)
        return self.last_plan

    def _land(self, so: SchedulerOutput, out: RunnerOutput) -> list[EngineCoreOutput]:
        """The pipeline's land phase: a finished step's results go to the scheduler."""
        if self.tp is not None:
            self.tp.finished()
        if out.step_path.startswith("dummy:"):  # an empty step the scheduler does not count
            paths = self.scheduler.stats.step_paths
            paths[out.step_path] = paths.get(out.step_path, 0) + 1
        if self.connector_worker is not None:
            out.kv_connector_output = self.connector_worker.get_finished()
        return self.scheduler.update_from_output(so, out)

    def supervise_connector(self) -> KVHealth:
        """Have the connector check (and restart) its threads; log health changes."""
        if self.connector_worker is None:
            return self.kv_health
        before = self.kv_health
        now = self.kv_health = self.connector_worker.supervise()
        if before.healthy and not now.healthy:
            logger.error("KV transfer unhealthy: %s", now.reason)
        elif now.healthy and not before.healthy:
            logger.warning("KV transfer healthy again (%d restart(s) so far)", now.restarts)
        return now

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and run one step; returns the outputs of the steps that landed.

        With ``async_scheduling`` (pipeline depth 1) the step is left in flight and
        the one launched by the previous call lands while this one's forward runs: the
        host schedules and prepares step N+1 while the device still runs step N (the
        scheduler counts N's tokens as placeholders until they land)."""
        if self.connector_worker is not None:
            t = time.monotonic()
            if t - self._supervised_at >= _SUPERVISE_EVERY_S:
                self._supervised_at = t
                self.supervise_connector()
        outputs = self._admit_compiled()
        if self.scheduler.waits_for_landed_tokens():
            # structured output: land the step in flight first (its tokens feed matchers)
            outputs += self.pipeline.drain(self._land)
        so = self.scheduler.schedule()
        # also when empty: the runner drops finished rows and the connector reports
        plan = self._begin(so)
        tp = self.tp
        launch = (lambda run: tp.launch(so, run)) if tp is not None else (lambda run: run())
        return outputs + self.pipeline.step(so, plan, self._land, self._masks, launch)

    def stats(self) -> SchedulerStats:
        s = self.scheduler.make_stats()
        # transfers are reported once: the snapshot takes the lists, the scheduler starts
        # anew; the snapshot owns its containers (a later step must not change it)
        self.scheduler.stats = replace(
            s,
            kv_transfer_seconds=[],
            kv_transfer_bytes=[],
            prompt_tokens_by_source=dict(s.prompt_tokens_by_source),
            step_paths=dict(s.step_paths),
            spec_num_accepted_tokens_per_pos=list(s.spec_num_accepted_tokens_per_pos),
            spec_steps_by_num_drafts=list(s.spec_steps_by_num_drafts),
        )
        if self.dp_sync is not None:
            s.dp_step_agreements = self.dp_sync.num_agreements
        h = self.kv_health
        s.kv_transfer_healthy = h.healthy
        s.kv_transfer_unhealthy_reason = h.reason
        s.kv_transfer_restarts = h.restarts
        s.kv_side_channel_rejected = dict(h.rejected)
        now = time.monotonic()
        if now - self._rss_read_at > 1.0:  # /proc read at most once a second
            s.process_rss_bytes["engine_core"] = read_rss_bytes()
            self._rss_read_at = now
        return s
