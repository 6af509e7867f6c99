"""The engine-core process: a busy loop around ``EngineCore`` fed by ZMQ.

Lifecycle: the parent starts this process with two ZMQ addresses. The process builds
the engine (weights, KV cache), sends ``EngineReady`` (or ``EngineError`` and exits),
then loops: take every pending message (blocking only while idle), run one step if
any request is unfinished, send that step's outputs plus a stats snapshot. It exits
on ``Shutdown``, or when the parent process goes away.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import zmq

from pdserve.config import EngineConfig
from pdserve.engine import messages as M
from pdserve.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)
_IDLE_POLL_MS = 200


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
        from pdserve.engine.engine_core import EngineCore

        core = EngineCore(config)
    except Exception as e:  # report start-up failures to the parent, then exit
        out.send(M.encode(M.EngineError(f"{type(e).__name__}: {e}")))
        logger.error("engine start-up failed:\n%s", traceback.format_exc())
        out.close(linger=1000)
        ctx.term()
        return
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
            )
        )
    )
    try:
        _loop(core, inp, out, parent)
    finally:
        inp.close(linger=0)
        out.close(linger=1000)
        ctx.term()


def _loop(core: object, inp: zmq.Socket, out: zmq.Socket, parent: int) -> None:
    from pdserve.engine.engine_core import EngineCore

    assert isinstance(core, EngineCore)
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    while True:
        busy = core.has_unfinished_requests()
        events = dict(poller.poll(0 if busy else _IDLE_POLL_MS))
        pending_outputs = []
        while events.get(inp):
            msg = M.decode_to_engine(inp.recv())
            if isinstance(msg, M.Shutdown):
                return
            if isinstance(msg, M.AddRequest):
                core.add_request(
                    Request(
                        request_id=msg.request_id,
                        prompt_token_ids=msg.prompt_token_ids,
                        sampling_params=msg.sampling_params,
                        eos_token_ids=frozenset(msg.eos_token_ids),
                        arrival_time=msg.arrival_time,
                        kv_transfer_params=msg.kv_transfer_params,
                        max_output_tokens=msg.max_output_tokens,
                    )
                )
            elif isinstance(msg, M.AbortRequests):
                status = (
                    RequestStatus.FINISHED_STOPPED
                    if msg.reason == "stop"
                    else RequestStatus.FINISHED_ABORTED
                )
                pending_outputs.extend(core.abort_requests(msg.request_ids, status))
            elif isinstance(msg, M.ResetPrefixCache):
                core.kv.reset_prefix_cache()
            events = dict(poller.poll(0))
        if core.has_unfinished_requests() or pending_outputs:
            pending_outputs.extend(core.step())
            out.send(M.encode(M.EngineOutputs(pending_outputs, core.stats(), time.time())))
        elif os.getppid() != parent:
            logger.warning("parent process is gone; exiting")
            return
        else:
            # idle: keep the stats fresh for /metrics and let the runner drop finished rows
            core.step()
            out.send(M.encode(M.EngineOutputs([], core.stats(), time.time())))
