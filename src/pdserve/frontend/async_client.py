"""The API server's handle on an engine-core process (implements ``EngineClient``).

Lifecycle: ``await AsyncEngineClient.start(config)`` spawns the engine-core process,
waits for ``EngineReady``, and starts one output task that reads every
``EngineOutputs`` message, detokenizes (``OutputProcessor``), and routes each delta
to its request's queue. ``generate`` takes one sample of a request its caller has
checked with :attr:`processor` (the API handlers do, once per HTTP request), builds the
``EngineCoreRequest``, registers a queue, sends it and yields deltas until the final
one; if the consumer goes away early the request is aborted in the engine.
If the engine process dies, every live request gets a final "error" output and
``check_health`` raises from then on. ``check_health`` also raises while the latest
stats snapshot says the engine's KV transfer side channel is down (the engine core
restarts it; the next healthy snapshot clears it).

Data parallelism (``--data-parallel-size N``): N engine-core processes, one per rank,
each with its own input socket; all push to the one output socket. The client waits for
every rank's ``EngineReady``, sends each new request to one rank
(:class:`~pdserve.frontend.dp_ranks.RankRouter`), its aborts to that rank, KV releases,
prefix-cache resets and shutdown to every rank, and merges the ranks' stats snapshots
(:func:`~pdserve.frontend.dp_ranks.merge_stats`). Under expert parallelism (the ranks
report ``lockstep``) every message to one rank is followed by a ``Wake`` to every rank.
One rank that dies or reports an error ends the whole instance: every live request gets
an error, ``check_health`` raises, and the other ranks are killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
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
from pdserve.frontend.dp_ranks import RankRouter, merge_ready, merge_stats
from pdserve.frontend.output_processor import OutputProcessor
from pdserve.frontend.outputs import CompletionOutput, RequestOutput
from pdserve.frontend.processor import InputProcessor
from pdserve.frontend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The engine-core process's entry point, named rather than imported: the API process
# loads no engine code (docs/ARCHITECTURE.md, process walls); the spawned child imports
# it. tests/test_layering.py checks that the name resolves.
ENGINE_CORE_ENTRY = ("pdserve.engine.core_proc", "run_engine_core")


def engine_core_main(*args: object) -> None:
    """Run in the spawned engine-core process: import its entry point and call it."""
    module, name = ENGINE_CORE_ENTRY
    getattr(importlib.import_module(module), name)(*args)


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
        self.dp_size = config.parallel.data_parallel_size
        self._ins = [self._ctx.socket(zmq.PUSH) for _ in range(self.dp_size)]
        for sock in self._ins:
            sock.setsockopt(zmq.SNDHWM, 0)  # never block a send on a busy rank
        self._out = self._ctx.socket(zmq.PULL)
        self._procs: list[mp.process.BaseProcess] = []
        self.ranks = RankRouter(self.dp_size)
        self.ready_ranks: list[M.EngineReady] = []
        self._rank_stats = [SchedulerStats() for _ in range(self.dp_size)]
        self._rss: dict[str, int] = {}
        self._lockstep = False
        self._wake_seq = 0
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
        out_addr = f"ipc://{os.path.join(self._tmp.name, 'out')}"
        self._out.bind(out_addr)
        init_file = os.path.join(self._tmp.name, "dist-init")  # the ranks' rendezvous
        for rank, sock in enumerate(self._ins):
            in_addr = f"ipc://{os.path.join(self._tmp.name, f'in{rank}')}"
            sock.bind(in_addr)
            proc = mp.get_context("spawn").Process(
                target=engine_core_main,
                args=(config, in_addr, out_addr, log_level, rank, init_file),
                name="pdserve-engine-core" + (f"-dp{rank}" if self.dp_size > 1 else ""),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
        try:
            ready = await self._wait_ready(timeout)
        except RuntimeError:
            await self.shutdown()
            raise
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.priority_scheduling = ready.priority_scheduling
        self._processor = InputProcessor(
            tok,
            self.max_model_len,
            self.vocab_size,
            speculative=ready.speculative,
            priority_scheduling=ready.priority_scheduling,
        )
        self._task = asyncio.create_task(self._output_loop())
        return self

    async def _wait_ready(self, timeout: float) -> M.EngineReady:
        ready: dict[int, M.EngineReady] = {}
        deadline = time.monotonic() + timeout
        while len(ready) < self.dp_size:
            if await self._out.poll(500):
                msg = M.decode_from_engine(await self._out.recv())
                if isinstance(msg, M.EngineError):
                    raise RuntimeError(
                        f"the engine failed to start: {self._where(msg.dp_rank)}{msg.message}"
                    )
                if isinstance(msg, M.EngineReady):
                    ready[msg.dp_rank] = msg
            for rank, proc in enumerate(self._procs):
                if not proc.is_alive():
                    raise RuntimeError(
                        f"the engine process{self._of_rank(rank)} exited during start-up "
                        f"(code {proc.exitcode})"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError("the engine did not become ready in time")
        self.ready_ranks = [ready[r] for r in range(self.dp_size)]
        self.ready = merged = merge_ready(self.ready_ranks)
        self._lockstep = any(r.lockstep for r in self.ready_ranks)
        if self.dp_size > 1:
            for r in self.ready_ranks:
                logger.info(
                    "data-parallel rank %d ready on %s: %d KV blocks of %d tokens",
                    r.dp_rank,
                    r.device,
                    r.num_blocks,
                    r.block_size,
                )
        return merged

    def _of_rank(self, rank: int) -> str:
        return f" of data-parallel rank {rank}" if self.dp_size > 1 else ""

    def _where(self, rank: int) -> str:
        return f"data-parallel rank {rank}: " if self.dp_size > 1 else ""

    # -- EngineClient -----------------------------------------------------------------------
    @property
    def processor(self) -> InputProcessor:
        """The requests' rules for this engine (ready once :meth:`start` returned)."""
        if self._processor is None:
            raise RuntimeError("the engine client has not started")
        return self._processor

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
        req = self._processor.build(request_id, prompt_token_ids, params, kv_transfer_params)
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = q
        self._outputs.add_request(request_id, prompt, req.prompt_token_ids, params)
        rank = self.ranks.assign(request_id)
        finished = False
        try:
            await self._send(req, rank)
            while True:
                out = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self.ranks.release(request_id)
            if not finished:
                self._outputs.remove(request_id)
                if not self._dead:
                    await self._send(M.AbortRequests([request_id]), rank)

    async def abort(self, request_id: str) -> None:
        rank = self.ranks.owner.get(request_id)
        if request_id in self._queues and rank is not None and not self._dead:
            await self._send(M.AbortRequests([request_id]), rank)

    def latest_stats(self) -> SchedulerStats:
        return self._stats

    @property
    def rank_stats(self) -> list[SchedulerStats]:
        """Each data-parallel rank's latest snapshot (one process: its snapshots)."""
        return [self._stats] if self.dp_size == 1 else list(self._rank_stats)

    @property
    def process_ids(self) -> list[int | None]:
        """The engine-core processes' ids, by data-parallel rank."""
        return [p.pid for p in self._procs]

    async def check_health(self) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise EngineDeadError(f"the engine process{self._of_rank(rank)} is not running")
        if not self._procs:
            raise EngineDeadError("the engine process is not running")
        check_stats_health(self._stats)

    async def reset_prefix_cache(self) -> None:
        await self._send_all(M.ResetPrefixCache())

    async def release_kv(self, request_id: str) -> None:
        """Prefill side: free the KV held for a remote decode of ``request_id`` now (every
        rank is told: the request may have finished on any of them; the others ignore it)."""
        if not self._dead:
            await self._send_all(M.ReleaseKV(request_id))

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        live = [p for p in self._procs if p.is_alive()]
        if live:
            with contextlib.suppress(Exception):
                await self._send_all(M.Shutdown())
            loop = asyncio.get_running_loop()
            for p in live:
                await loop.run_in_executor(None, p.join, 10)
            for p in live:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        for sock in self._ins:
            sock.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        self._tmp.cleanup()

    # -- internals ----------------------------------------------------------------------------
    async def _push(self, rank: int, buf: bytes) -> None:
        """Queue ``buf`` for one rank without blocking (the input sockets have no high-water
        mark, so only a rank whose process is gone refuses it: then the engine is dead)."""
        try:
            await self._ins[rank].send(buf, flags=zmq.NOBLOCK)
        except zmq.Again:
            why = self._dead_process() or f"data-parallel rank {rank} stopped reading"
            if not self._dead:
                self._fail_all(why)
            raise EngineDeadError(self._dead or why) from None

    async def _send(self, msg: M.ToEngine, rank: int) -> None:
        """To one rank; under expert parallelism every rank then gets a wake."""
        await self._push(rank, M.encode(msg))
        if self._lockstep:
            self._wake_seq += 1
            wake = M.encode(M.Wake(self._wake_seq))
            for r in range(self.dp_size):
                await self._push(r, wake)

    async def _send_all(self, msg: M.ToEngine) -> None:
        buf = M.encode(msg)
        for r in range(self.dp_size):
            await self._push(r, buf)

    def _observe(self, msg: M.EngineOutputs) -> SchedulerStats:
        """The instance's stats after rank ``msg.dp_rank``'s snapshot."""
        if self.dp_size == 1:
            return msg.stats
        rank = msg.dp_rank
        self._rank_stats[rank] = msg.stats
        rss = msg.stats.process_rss_bytes.get("engine_core")
        if rss is not None:
            self._rss[f"engine_core_dp{rank}"] = rss
        blocks = [r.num_blocks for r in self.ready_ranks]
        return merge_stats(self._rank_stats, blocks, self._rss, msg.stats)

    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._out.poll(1000 if self.dp_size == 1 else 200):
                    dead = self._dead_process()
                    if dead:
                        self._fail_all(dead)
                        return
                    continue
                msg = M.decode_from_engine(await self._out.recv())
                if isinstance(msg, M.EngineError):
                    # a rank whose peer died fails in its next collective: name the dead one
                    why = self._where(msg.dp_rank) + msg.message
                    dead = self._dead_process()
                    self._fail_all(f"{dead}; {why}" if dead else why)
                    return
                if not isinstance(msg, M.EngineOutputs):
                    continue
                self._stats = self._observe(msg)
                if self.on_stats is not None:
                    self.on_stats(self._stats)
                if not msg.outputs:
                    continue
                results, stopped = self._outputs.process(msg.outputs, delta=True)
                for rid in stopped:
                    rank = self.ranks.owner.get(rid)
                    stop = M.AbortRequests([rid], reason="stop")
                    await (self._send_all(stop) if rank is None else self._send(stop, rank))
                for r in results:
                    q = self._queues.get(r.request_id)
                    if q is not None:
                        q.put_nowait(r)
        except asyncio.CancelledError:
            raise
        except EngineDeadError:  # a rank went away while we sent to it: already failed
            return
        except Exception as e:  # a bug here must not hang every client
            logger.exception("output loop failed")
            self._fail_all(f"output loop failed: {e}")

    def _dead_process(self) -> str | None:
        for rank, p in enumerate(self._procs):
            if not p.is_alive():
                return f"the engine process{self._of_rank(rank)} died (exit code {p.exitcode})"
        return None

    def _fail_all(self, why: str) -> None:
        self._dead = why
        logger.error("engine failed: %s", why)
        if self.dp_size > 1:  # one rank lost: the others cannot step on (kill, not wait)
            for p in self._procs:
                if p.is_alive():
                    p.kill()
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
