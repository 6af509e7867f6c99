"""The API server's handle on an engine-core process (implements ``EngineClient``).

Lifecycle: ``await AsyncEngineClient.start(config)`` spawns the engine-core process,
waits for ``EngineReady``, and starts one output task that reads every
``EngineOutputs`` message, detokenizes (``OutputProcessor``), and routes each delta
to its request's queue. ``generate`` validates first (``ValueError`` before anything
is queued), registers a queue, sends the ``EngineCoreRequest`` and yields deltas until the
final one; if the consumer goes away early the request is aborted in the engine.
If the engine process dies, every live request gets a final "error" output and
``check_health`` raises from then on. ``check_health`` also raises while the latest
stats snapshot says the engine's KV transfer side channel is down (the engine core
restarts it; the next healthy snapshot clears it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from pdserve.config import EngineConfig
from pdserve.core_types import messages as M
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.core_types.stats import SchedulerStats
from pdserve.engine.core_proc import run_engine_core
from pdserve.frontend.output_processor import OutputProcessor
from pdserve.frontend.outputs import CompletionOutput, RequestOutput
from pdserve.frontend.processor import InputProcessor
from pdserve.frontend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class EngineUnhealthyError(RuntimeError):
    """The engine runs but part of it is down (e.g. its KV transfer side channel)."""


def check_stats_health(stats: SchedulerStats) -> None:
    """Raise :class:`EngineUnhealthyError` if a stats snapshot reports a fault."""
    if not stats.kv_transfer_healthy:
        raise EngineUnhealthyError(
            f"KV transfer is down: {stats.kv_transfer_unhealthy_reason or 'no reason given'}"
        )


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = 0
        self.vocab_size = 0
        self.priority_scheduling = False
        self.ready: M.EngineReady | None = None
        self._stats = SchedulerStats()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._outputs = OutputProcessor(tokenizer)
        self._dead: str | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-")
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        self._proc: mp.process.BaseProcess | None = None
        self._task: asyncio.Task | None = None
        self._processor: InputProcessor | None = None
        # called with every stats snapshot (each carries only its own step's transfers)
        self.on_stats: Callable[[SchedulerStats], None] | None = None

    @classmethod
    async def start(
        cls, config: EngineConfig, log_level: str = "INFO", timeout: float = 1800.0
    ) -> AsyncEngineClient:
        tok = Tokenizer.from_pretrained(config.model.tokenizer or config.model.model)
        self = cls(config, tok)
        in_addr = f"ipc://{os.path.join(self._tmp.name, 'in')}"
        out_addr = f"ipc://{os.path.join(self._tmp.name, 'out')}"
        self._in.bind(in_addr)
        self._out.bind(out_addr)
        self._proc = mp.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, in_addr, out_addr, log_level),
            name="pdserve-engine-core",
            daemon=True,
        )
        self._proc.start()
        deadline = time.monotonic() + timeout
        while True:
            if await self._out.poll(500):
                msg = M.decode_from_engine(await self._out.recv())
                if isinstance(msg, M.EngineError):
                    await self.shutdown()
                    raise RuntimeError(f"the engine failed to start: {msg.message}")
                if isinstance(msg, M.EngineReady):
                    self.ready = msg
                    break
            if not self._proc.is_alive():
                await self.shutdown()
                raise RuntimeError(
                    f"the engine process exited during start-up (code {self._proc.exitcode})"
                )
            if time.monotonic() > deadline:
                await self.shutdown()
                raise RuntimeError("the engine did not become ready in time")
        self.max_model_len = self.ready.max_model_len
        self.vocab_size = self.ready.vocab_size
        self.priority_scheduling = self.ready.priority_scheduling
        self._processor = InputProcessor(
            tok,
            self.max_model_len,
            self.vocab_size,
            speculative=self.ready.speculative,
            priority_scheduling=self.ready.priority_scheduling,
        )
        self._task = asyncio.create_task(self._output_loop())
        return self

    # -- EngineClient -----------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self._dead:
            raise EngineDeadError(self._dead)
        assert self._processor is not None
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self._processor.make_request(request_id, prompt_token_ids, params, kv_transfer_params)
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = q
        self._outputs.add_request(request_id, prompt, req.prompt_token_ids, params)
        finished = False
        try:
            await self._send(req)
            while True:
                out = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._outputs.remove(request_id)
                if not self._dead:
                    await self._send(M.AbortRequests([request_id]))

    async def abort(self, request_id: str) -> None:
        if request_id in self._queues and not self._dead:
            await self._send(M.AbortRequests([request_id]))

    def latest_stats(self) -> SchedulerStats:
        return self._stats

    async def check_health(self) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        if self._proc is None or not self._proc.is_alive():
            raise EngineDeadError("the engine process is not running")
        check_stats_health(self._stats)

    async def reset_prefix_cache(self) -> None:
        await self._send(M.ResetPrefixCache())

    async def release_kv(self, request_id: str) -> None:
        """Prefill side: free the KV held for a remote decode of ``request_id`` now."""
        if not self._dead:
            await self._send(M.ReleaseKV(request_id))

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(Exception):
                await self._in.send(M.encode(M.Shutdown()))
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        self._tmp.cleanup()

    # -- internals ----------------------------------------------------------------------------
    async def _send(self, msg: M.ToEngine) -> None:
        await self._in.send(M.encode(msg))

    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._out.poll(1000):
                    if self._proc is not None and not self._proc.is_alive():
                        self._fail_all(f"the engine process died (exit code {self._proc.exitcode})")
                        return
                    continue
                msg = M.decode_from_engine(await self._out.recv())
                if isinstance(msg, M.EngineError):
                    self._fail_all(msg.message)
                    return
                if not isinstance(msg, M.EngineOutputs):
                    continue
                self._stats = msg.stats
                if self.on_stats is not None:
                    self.on_stats(msg.stats)
                if not msg.outputs:
                    continue
                results, stopped = self._outputs.process(msg.outputs, delta=True)
                if stopped:
                    await self._send(M.AbortRequests(stopped, reason="stop"))
                for r in results:
                    q = self._queues.get(r.request_id)
                    if q is not None:
                        q.put_nowait(r)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not hang every client
            logger.exception("output loop failed")
            self._fail_all(f"output loop failed: {e}")

    def _fail_all(self, why: str) -> None:
        self._dead = why
        for rid, q in list(self._queues.items()):
            self._outputs.remove(rid)
            q.put_nowait(
                RequestOutput(
                    rid,
                    None,
                    [],
                    [CompletionOutput(0, "", [], finish_reason="error")],
                    True,
                    error=why,
                )
            )
