"""The engine-core process: a busy loop around ``EngineCore`` fed by ZMQ.

Lifecycle: the parent starts this process with two ZMQ addresses. The process builds
the engine (weights, KV cache), sends ``EngineReady`` (or ``EngineError`` and exits),
then loops: take every pending message (blocking only while idle), run one step if
any request is unfinished, send that step's outputs plus a stats snapshot. It exits
on ``Shutdown``, or when the parent process goes away; a step that raises (a
tensor-parallel rank died) is reported as ``EngineError`` before it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import zmq

from pdserve.config import EngineConfig
from pdserve.core_types import messages as M
from pdserve.core_types.scheduler_output import EngineCoreOutput
from pdserve.core_types.stats import SchedulerStats, stats_line
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import RequestStatus
from pdserve.heap import freeze_startup_heap

logger = logging.getLogger(__name__)
_IDLE_POLL_MS = 200
_REMOTE_POLL_MS = 2
_STATS_EVERY_S = 0.1
_LOG_STATS_EVERY_S = 10.0


def run_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, log_level: str
) -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s engine-core: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    parent = os.getppid()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    try:
        core = EngineCore(config)
    except Exception as e:  # report start-up failures to the parent, then exit
        out.send(M.encode(M.EngineError(f"{type(e).__name__}: {e}")))
        logger.error("engine start-up failed:\n%s", traceback.format_exc())
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
            )
        )
    )
    try:
        _loop(core, inp, out, parent)
    except Exception as e:  # e.g. a tensor-parallel rank died: fail every request, exit
        logger.error("engine step failed:\n%s", traceback.format_exc())
        out.send(M.encode(M.EngineError(f"{type(e).__name__}: {e}")))
        raise SystemExit(1) from e
    finally:
        core.shutdown()
        inp.close(linger=0)
        out.close(linger=1000)
        ctx.term()


def _loop(core: EngineCore, inp: zmq.Socket, out: zmq.Socket, parent: int) -> None:
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    last_sent = 0.0
    log_stats = not core.config.scheduler.disable_log_stats
    logged, logged_at = SchedulerStats(), time.monotonic()
    while True:
        if core.has_schedulable_work():
            timeout = 0
        elif core.has_unfinished_requests():  # only waiting for remote KV: poll often
            timeout = _REMOTE_POLL_MS
        else:
            timeout = _IDLE_POLL_MS
        events = dict(poller.poll(timeout))
        outputs: list[EngineCoreOutput] = []
        while events.get(inp):
            msg = M.decode_to_engine(inp.recv())
            if isinstance(msg, M.Shutdown):
                return
            outputs.extend(_handle(core, msg))
            events = dict(poller.poll(0))
        if os.getppid() != parent:
            logger.warning("parent process is gone; exiting")
            return
        # a step also runs when idle: it frees released/expired KV and drops finished rows
        outputs.extend(core.step())
        now = time.monotonic()
        if outputs or now - last_sent >= _STATS_EVERY_S:
            stats = core.stats()
            out.send(M.encode(M.EngineOutputs(outputs, stats, time.time())))
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
    return []
