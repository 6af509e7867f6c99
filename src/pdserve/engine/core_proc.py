"""The engine-core process: a busy loop around ``EngineCore`` fed by ZMQ.

Lifecycle: the parent starts this process with two ZMQ addresses. The process builds
the engine (weights, KV cache), sends ``EngineReady`` (or ``EngineError`` and exits),
then loops: take every pending message (blocking only while idle), run one step if
any request is unfinished, send that step's outputs plus a stats snapshot. It exits
on ``Shutdown``, or when the parent process goes away; an exception in the loop (a
tensor- or data-parallel peer rank that died makes the next collective raise) is
reported as ``EngineError`` before it exits with status 1.

Data parallelism: the parent starts one such process per DP rank (``dp_rank``), all
with the same output address and each with its own input address; they join one
process group through ``init_file`` before building their engines. Under expert
parallelism the ranks step in lockstep (:mod:`pdserve.distributed.dp_sync`): each
iteration runs one agreement, the poll timeout follows the last plan as well as this
rank's own work (0 while any rank computes), and a rank that has read fewer wake
messages than a peer waits on its socket for them before the next agreement.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import traceback
from dataclasses import replace

import torch
import zmq

from pdserve.config import EngineConfig
from pdserve.core_types import messages as M
from pdserve.core_types.scheduler_output import EngineCoreOutput
from pdserve.core_types.stats import SchedulerStats, stats_line
from pdserve.distributed.device import rank_device
from pdserve.distributed.groups import ParallelGroups, RankInfo, init_parallel_groups
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import RequestStatus
from pdserve.heap import freeze_startup_heap

logger = logging.getLogger(__name__)
_IDLE_POLL_MS = 200
_REMOTE_POLL_MS = 2
_STATS_EVERY_S = 0.1
_LOG_STATS_EVERY_S = 10.0


def _join_ranks(config: EngineConfig, dp_rank: int, init_file: str | None) -> ParallelGroups:
    """This rank's process groups (size-1 groups for a single-rank instance)."""
    info = RankInfo(dp_size=config.parallel.data_parallel_size, dp_rank=dp_rank)
    if info.world_size == 1:
        return ParallelGroups(info=info)
    if init_file is None:
        raise ValueError("a multi-rank instance needs a rendezvous file")
    device = rank_device(config.device.device, info)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches on the current device
    else:  # ranks share the host's cores: oversubscribed (spinning) threads stall peers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        torch.set_num_threads(max(1, cores // info.world_size))
    return init_parallel_groups(
        info, init_file, device, expert_parallel=config.parallel.enable_expert_parallel
    )


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    log_level: str,
    dp_rank: int = 0,
    init_file: str | None = None,
) -> None:
    name = "engine-core" if config.parallel.data_parallel_size == 1 else f"engine-core[dp{dp_rank}]"
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s %(levelname)s {name}: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    parent = os.getppid()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    groups = ParallelGroups()
    try:
        groups = _join_ranks(config, dp_rank, init_file)
        if groups.info.world_size > 1:  # this rank's own device
            dev = rank_device(config.device.device, groups.info)
            config = replace(config, device=replace(config.device, device=str(dev)))
        core = EngineCore(config, groups=groups)
    except Exception as e:  # report start-up failures to the parent, then exit
        out.send(M.encode(M.EngineError(f"{type(e).__name__}: {e}", dp_rank)))
        logger.error("engine start-up failed:\n%s", traceback.format_exc())
        with contextlib.suppress(Exception):
            groups.destroy()
        out.close(linger=1000)
        ctx.term()
        return
    freeze_startup_heap()  # before ready: no GC pass walks the start-up heap under traffic
    r = core.runner
    out.send(
        M.encode(
            M.EngineReady(
                core.max_model_len,
                core.vocab_size,
                r.num_blocks,
                r.block_size,
                str(r.device),
                core.startup_seconds,
                core.config.speculative is not None,
                core.config.scheduler.scheduling_policy == "priority",
                dp_rank,
                core.dp_sync is not None,
            )
        )
    )
    try:
        _loop(core, inp, out, parent)
    except Exception as e:  # e.g. a peer rank died: its collective raised here
        logger.error("engine loop failed:\n%s", traceback.format_exc())
        out.send(M.encode(M.EngineError(f"{type(e).__name__}: {e}", dp_rank)))
        raise SystemExit(1) from e
    finally:
        core.shutdown()
        with contextlib.suppress(Exception):  # a peer may be gone already
            groups.destroy()
        inp.close(linger=0)
        out.close(linger=1000)
        ctx.term()


def _poll_timeout_ms(core: EngineCore) -> int:
    plan = core.last_plan  # None unless the ranks step in lockstep
    if core.has_schedulable_work() or (plan and (plan.any_busy or not plan.wake_seq_agrees)):
        return 0
    if core.has_unfinished_requests() or (plan and plan.any_pending):
        return _REMOTE_POLL_MS  # only waiting for remote KV (here or on a peer): poll often
    return _IDLE_POLL_MS


def _read(
    core: EngineCore, inp: zmq.Socket, poller: zmq.Poller, timeout_ms: int
) -> list[EngineCoreOutput] | None:
    """Handle every message that arrives within ``timeout_ms`` (then every pending one);
    None on ``Shutdown``."""
    outputs: list[EngineCoreOutput] = []
    events = dict(poller.poll(timeout_ms))
    while events.get(inp):
        msg = M.decode_to_engine(inp.recv())
        if isinstance(msg, M.Shutdown):
            return None
        outputs.extend(_handle(core, msg))
        events = dict(poller.poll(0))
    return outputs


def _behind(core: EngineCore) -> bool:
    plan = core.last_plan
    return plan is not None and core.wake_seq < plan.max_wake_seq


def _loop(core: EngineCore, inp: zmq.Socket, out: zmq.Socket, parent: int) -> None:
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    last_sent = 0.0
    log_stats = not core.config.scheduler.disable_log_stats
    logged, logged_at = SchedulerStats(), time.monotonic()
    lockstep = core.dp_sync is not None
    while True:
        outputs = _read(core, inp, poller, 0 if core.stopping else _poll_timeout_ms(core))
        # lockstep: a peer read a wake this rank has not; its work precedes that wake
        while outputs is not None and _behind(core) and os.getppid() == parent:
            more = _read(core, inp, poller, _IDLE_POLL_MS)
            outputs = None if more is None else outputs + more
        if outputs is None:  # Shutdown: under lockstep, leave with the peers (dp_sync)
            if not lockstep:
                return
            core.stopping, outputs = True, []
        if os.getppid() != parent:
            logger.warning("parent process is gone; exiting")
            return
        # a step also runs when idle: it frees released/expired KV and drops finished rows
        outputs.extend(core.step())
        if core.last_plan is not None and core.last_plan.stop:
            return
        now = time.monotonic()
        if outputs or now - last_sent >= _STATS_EVERY_S:
            stats = core.stats()
            out.send(M.encode(M.EngineOutputs(outputs, stats, time.time(), core.dp_rank)))
            last_sent = now
            if log_stats and now - logged_at >= _LOG_STATS_EVERY_S:
                if stats.num_steps != logged.num_steps:  # quiet while idle
                    logger.info("%s", stats_line(logged, stats, now - logged_at))
                logged, logged_at = stats, now


def _handle(core: EngineCore, msg: M.ToEngine) -> list[EngineCoreOutput]:
    if isinstance(msg, M.EngineCoreRequest):
        try:
            core.add_request(msg)
        except ValueError as e:  # e.g. a duplicate request id: fail this request only
            return [EngineCoreOutput(msg.request_id, [], finish_reason="error", error=str(e))]
    elif isinstance(msg, M.AbortRequests):
        status = (
            RequestStatus.FINISHED_STOPPED
            if msg.reason == "stop"
            else RequestStatus.FINISHED_ABORTED
        )
        return core.abort_requests(msg.request_ids, status)
    elif isinstance(msg, M.ResetPrefixCache):
        core.kv.reset_prefix_cache()
    elif isinstance(msg, M.ReleaseKV):
        core.release_kv(msg.request_id)
    elif isinstance(msg, M.Wake):
        core.wake_seq = max(core.wake_seq, msg.seq)
    return []
