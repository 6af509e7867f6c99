"""Tensor parallelism inside one instance: the leader rank and its followers.

The engine core is TP rank 0, the *leader*: it alone runs the scheduler and the KV cache
manager. :class:`TPLeader` starts ``tp_size - 1`` *follower* processes, one per further
rank, each with its own device (``cuda:<base + rank>``; the CPU on CPU) and its own
:class:`~pdserve.runner.model_runner.ModelRunner` over its shard of the weights.

Lifecycle (every rank runs the same sequence; forwards are collective):

1. start-up: join the process groups (a FileStore in a private temp dir), build the
   runner, :func:`start_runner` (KV blocks: each rank's count, then the minimum over
   the ranks; allocate; warm up);
2. per step: the leader broadcasts a :class:`TPStep` over the TP group's CPU (gloo)
   group, then runs it through its step pipeline; a follower receives it, first
   finishes as many of its oldest launched steps as the leader finished since the last
   broadcast, then launches the same step (the pipeline's phases but land). What a step
   reads of the steps before it is the request state on each rank's device, written in
   the same stream order on every rank, so a follower's landing later than the
   leader's changes nothing. A follower's results are identical (logits are all-gathered,
   every rank's sampler has the same seed) and dropped. Steps the runner would do
   nothing for (empty, no rows to drop) are not broadcast;
3. shutdown: the leader broadcasts a ``TPStep`` without a step; followers exit.

Failures: a follower that dies makes the leader's next collective raise (gloo notices
the closed connection at once); :meth:`TPLeader.launch` turns that into a
:class:`RankFailure` naming the rank, its exit code and its start-up error if it wrote
one, and the engine core reports it as an engine error and exits. Where a collective
would hang instead (NCCL does not notice a dead peer), a watchdog thread ends the leader
after ``grace_s`` spent inside a collective with a dead follower. Followers exit when
the leader goes away (a collective error, or their parent pid changes).

Followers are started with ``subprocess`` (not ``multiprocessing``): the engine-core
process is a daemonic multiprocessing child, which may not have children of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.core_types.scheduler_output import SchedulerOutput
from pdserve.distributed.device import rank_device
from pdserve.distributed.groups import Group, ParallelGroups, RankInfo, init_parallel_groups
from pdserve.runner.model_runner import ModelRunner
from pdserve.runner.step_outputs import StepHandle
from pdserve.runner.step_pipeline import StepPipeline

logger = logging.getLogger(__name__)

_WATCH_EVERY_S = 0.2
_STUCK_GRACE_S = 10.0
_EXIT_WAIT_S = 10.0
_NOTICE_WAIT_S = 2.0  # after a collective error: how long to wait for a dead rank to show


class RankFailure(RuntimeError):
    """A tensor-parallel rank died; the instance cannot go on."""


class TPStep(msgspec.Struct):
    """One broadcast from the leader: finish the ``finish`` oldest launched steps, then
    launch ``step``; ``step`` None ends the follower."""

    finish: int
    step: SchedulerOutput | None


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # the structured-output bitmask
        return (str(obj.dtype), list(obj.shape), obj.tobytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    raise NotImplementedError(f"cannot decode {tp}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(TPStep, dec_hook=_dec_hook)


def encode_step(msg: TPStep) -> bytes:
    return _encoder.encode(msg)


def decode_step(buf: bytes) -> TPStep:
    return _decoder.decode(buf)


def runner_ignores(so: SchedulerOutput) -> bool:
    """Whether launching ``so`` changes nothing in a runner (no tokens, no rows to add,
    update or drop): such steps are not broadcast."""
    return (
        so.is_empty
        and not so.finished_req_ids
        and not so.preempted_req_ids
        and not so.scheduled_new_reqs
        and not so.scheduled_cached_reqs
    )


# -- every rank ------------------------------------------------------------------------------
def init_rank(
    config: EngineConfig, tp_rank: int, init_file: str
) -> tuple[EngineConfig, ParallelGroups]:
    """(this rank's config: its own device, the groups): joins the instance's ranks.
    Makes the rank's device current (CUDA), or gives the rank its share of the host's
    torch threads (CPU; in-process, the offline ``LLM``'s thread count too)."""
    tp_size = config.parallel.tensor_parallel_size
    dev = rank_device(config.device.device, RankInfo(tp_size=tp_size, tp_rank=tp_rank))
    config = replace(config, device=replace(config.device, device=str(dev)))
    if dev.type == "cuda":  # streams, events, graphs and Triton use the current device
        torch.cuda.set_device(dev)
    else:  # the ranks share this host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // tp_size))
    info = RankInfo(tp_size=tp_size, tp_rank=tp_rank)
    return config, init_parallel_groups(info, init_file, dev)


def start_runner(runner: ModelRunner, tp: Group) -> tuple[int, dict[str, float]]:
    """(KV blocks, warm-up seconds per phase): the start-up every rank runs in step.
    The block count is the smallest any rank can hold (all ranks address the same ids)."""
    num_blocks = -tp.max_cpu([-runner.determine_num_blocks()])[0]
    runner.initialize_kv_cache(num_blocks)
    return num_blocks, runner.warm_up()


def check_tp_config(config: EngineConfig) -> None:
    """Refuse what tensor parallelism does not support, and shapes that do not split
    (the model is built on the meta device with this TP size), with clear messages."""
    from pdserve.models.loader import check_model_options

    n = config.parallel.tensor_parallel_size
    if config.kv_transfer is not None:
        raise ValueError(
            f"--kv-transfer-config (P/D) with --tensor-parallel-size {n} is not supported yet"
        )
    rank_device(config.device.device, RankInfo(tp_size=n, tp_rank=n - 1))  # one GPU per rank
    spec = config.speculative
    options: dict[str, Any] = (
        {"with_mtp": True} if spec is not None and spec.method == "mtp" else {}
    )
    shape_only = Group(size=n, rank=0, ranks=tuple(range(n)))  # no process group: never run
    groups = ParallelGroups(info=RankInfo(tp_size=n), tp=shape_only)
    check_model_options(config.model.model, config.model.quantization, groups=groups, **options)


# -- the leader ------------------------------------------------------------------------------
@dataclass
class FollowerSpec:
    """What a follower process is started with (pickled to its stdin)."""

    config: EngineConfig
    tp_rank: int
    init_file: str
    error_file: str
    leader_pid: int
    log_level: int


class TPLeader:
    """The leader's side: the follower processes, the step broadcast, the watchdog.

    Lifecycle: construct (starts the followers and joins the groups; ``config`` and
    ``groups`` are then this rank's) → the caller builds its runner and runs
    :func:`start_runner` inside :meth:`collective` → :meth:`launch` / :meth:`finished`
    per step → :meth:`shutdown` (also after a failure)."""

    def __init__(self, config: EngineConfig, grace_s: float = _STUCK_GRACE_S) -> None:
        self.size = config.parallel.tensor_parallel_size
        check_tp_config(config)  # before any process starts
        self.grace_s = grace_s
        self._dir = tempfile.mkdtemp(prefix="pdserve-tp-")
        self._procs: list[subprocess.Popen[bytes]] = []
        self._dead: str | None = None
        self._closed = False
        self.serving = False  # start-up done on every rank: followers wait for steps
        self._broken = False  # an error escaped a collective: the ranks are out of step
        self._busy_since: float | None = None
        self._mirrored: deque[bool] = deque()  # per launched step: whether it was broadcast
        self._to_finish = 0  # broadcast steps finished since the last broadcast
        self.groups = ParallelGroups()
        init_file = os.path.join(self._dir, "init")
        try:
            for rank in range(1, self.size):
                self._procs.append(self._spawn(config, rank, init_file))
            threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
            with self.collective():
                self.config, self.groups = init_rank(config, 0, init_file)
        except BaseException:
            self.shutdown()
            raise
        # an owner that never shuts it down (an LLM left to the interpreter's exit): the
        # followers still leave on the shutdown broadcast, not on a broken connection
        atexit.register(self.shutdown)

    def _spawn(self, config: EngineConfig, rank: int, init_file: str) -> subprocess.Popen[bytes]:
        spec = FollowerSpec(
            config,
            rank,
            init_file,
            os.path.join(self._dir, f"rank{rank}.error"),
            os.getpid(),
            logging.getLogger().getEffectiveLevel(),
        )
        code = "from pdserve.engine.tp_workers import follower_main; follower_main()"
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.close()
        return proc

    # -- failures ---------------------------------------------------------------------------
    def _death(self) -> str | None:
        """Why the instance cannot go on (the first follower found exited), or None."""
        if self._dead is None:
            for rank, proc in enumerate(self._procs, start=1):
                code = proc.poll()
                if code is None:
                    continue
                why = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
                err = os.path.join(self._dir, f"rank{rank}.error")
                if os.path.exists(err):
                    with open(err, encoding="utf-8", errors="replace") as f:
                        why += f": {f.read().strip()}"
                self._dead = why
                break
        return self._dead

    def _watch(self) -> None:
        noticed_at: float | None = None
        while not self._closed:
            time.sleep(_WATCH_EVERY_S)
            if self._closed or self._death() is None:
                continue
            now = time.monotonic()
            if noticed_at is None:
                noticed_at = now
                logger.error("%s", self._dead)
            busy = self._busy_since
            if busy is not None and now - max(busy, noticed_at) > self.grace_s:
                logger.error(
                    "the leader is stuck in a collective with a dead rank; exiting (%s)",
                    self._dead,
                )
                os._exit(1)

    def check(self) -> None:
        """Raise :class:`RankFailure` if a follower has exited."""
        why = self._death()
        if why is not None:
            raise RankFailure(why)

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """A section in which the leader takes part in collectives: an error in it caused
        by a dead follower becomes a :class:`RankFailure`; the watchdog ends the process
        when it stays inside one too long after a follower died."""
        self._busy_since = time.monotonic()
        try:
            yield
        except BaseException as e:
            self._broken = True
            if isinstance(e, RankFailure) or not isinstance(e, RuntimeError):
                raise
            deadline = time.monotonic() + _NOTICE_WAIT_S
            while self._death() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._dead is not None:
                raise RankFailure(f"{self._dead} ({type(e).__name__}: {e})") from e
            raise
        finally:
            self._busy_since = None

    # -- steps ------------------------------------------------------------------------------
    def launch(self, so: SchedulerOutput, launch: Callable[[], StepHandle]) -> StepHandle:
        """Broadcast ``so`` to the followers (unless the runner ignores it), then
        ``launch()`` it on this rank (whose land phase may finish earlier steps)."""
        self.check()
        mirrored = not runner_ignores(so)
        with self.collective():
            if mirrored:
                self.groups.tp.broadcast_bytes(encode_step(TPStep(self._to_finish, so)))
                self._to_finish = 0
            self._mirrored.append(mirrored)
            return launch()

    def finished(self) -> None:
        """The leader finished its oldest launched step (steps finish in launch order)."""
        if self._mirrored.popleft():
            self._to_finish += 1

    def shutdown(self) -> None:
        """End the followers (a shutdown broadcast when they wait for a step, else a kill)
        and remove the temp dir. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        healthy = self.serving and not self._broken and self._death() is None
        if healthy:
            try:
                self.groups.tp.broadcast_bytes(encode_step(TPStep(self._to_finish, None)))
            except RuntimeError:
                healthy = False
        deadline = time.monotonic() + (_EXIT_WAIT_S if healthy else 0.0)
        for proc in self._procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if healthy:
            self.groups.destroy()
        shutil.rmtree(self._dir, ignore_errors=True)


# -- a follower ------------------------------------------------------------------------------
def follower_main() -> None:
    """Entry point of a follower process: its spec comes pickled on stdin."""
    spec: FollowerSpec = pickle.loads(sys.stdin.buffer.read())
    rank = spec.tp_rank
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s %(levelname)s tp-rank-{rank}: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the leader decides when we stop
    threading.Thread(target=_watch_leader, args=(spec.leader_pid,), daemon=True).start()
    try:
        config, groups = init_rank(spec.config, rank, spec.init_file)
        runner = ModelRunner(config, groups=groups)
        start_runner(runner, groups.tp)
    except Exception as e:
        logger.exception("start-up failed")
        with open(spec.error_file, "w", encoding="utf-8") as f:
            f.write(f"start-up failed: {type(e).__name__}: {e}")
        sys.exit(1)
    logger.info("ready on %s", runner.device)
    try:
        serve(runner, groups.tp)
    except RuntimeError as e:  # the leader went away mid-collective
        logger.error("leaving: %s", e)
        sys.exit(1)
    groups.destroy()


def serve(runner: ModelRunner, tp: Group) -> None:
    """Mirror the leader's steps until it broadcasts the end (see the module docstring)."""
    pipeline = StepPipeline(runner)
    pipeline.depth = 1  # the leader may broadcast a step before the one before lands
    handles: deque[StepHandle] = deque()
    with torch.inference_mode():
        while True:
            msg = decode_step(tp.broadcast_bytes(None))
            for _ in range(msg.finish):
                pipeline.finish(handles.popleft())
            if msg.step is None:
                return
            handles.append(pipeline.launch(msg.step))


def _watch_leader(leader_pid: int) -> None:
    while os.getppid() == leader_pid:
        time.sleep(1.0)
    os._exit(1)  # the leader is gone: nothing this rank computes is wanted any more
