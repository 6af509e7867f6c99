"""Blocking work of the API app (tokenization, chat templates, detokenization, large
JSON bodies) off the event loop, with bounded concurrency.

A :class:`BlockingPool` has ``threads`` worker threads (at least 2). Every job states
its size (characters or token ids); a *large* job (``size >= large_job``) must hold one
of ``threads - 1`` large-job slots while it runs, so one thread is always left for
small jobs: a huge ``/tokenize`` never queues the tokenization of an ordinary prompt
behind it, and large jobs wait their turn without holding a thread. A slot is freed
when the job's thread finishes, not when its caller gives up (a cancelled caller
cannot let more large jobs run than there are slots).

The tokenizer backend releases the GIL while it encodes, so the event loop keeps
serving meanwhile. After a large job the worker hands the freed native heap back to
the OS (glibc ``malloc_trim``): encoding 10 MB of text allocates about 1 GB in the
tokenizer's Rust code, which glibc would otherwise keep in the process for good.

Lifecycle: made with the app, threads started on first use, :meth:`close` at lifespan
shutdown (a restarted lifespan starts threads again).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_THREADS = 2
# characters (or token ids) from which a job counts as large: ~10 ms of tokenizing
DEFAULT_LARGE_JOB = 32_768


class BlockingPool:
    """See the module docstring."""

    def __init__(self, threads: int = DEFAULT_THREADS, large_job: int = DEFAULT_LARGE_JOB) -> None:
        if threads < 2:
            raise ValueError(f"the blocking pool needs at least 2 threads, got {threads}")
        self.threads = threads
        self.large_job = large_job
        self._executor: ThreadPoolExecutor | None = None
        self._large_slots: asyncio.Semaphore | None = None

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="pdserve-blocking")
            self._large_slots = asyncio.Semaphore(self.threads - 1)
        return self._executor

    async def run(self, fn: Callable[..., T], *args: Any, job_size: int = 0, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a worker thread; ``job_size`` decides whether it is large."""
        pool = self._pool()
        call = functools.partial(fn, *args, **kwargs)
        if job_size < self.large_job:
            return await asyncio.wrap_future(pool.submit(call))
        slots = self._large_slots
        assert slots is not None
        await slots.acquire()
        try:
            fut: Future[T] = pool.submit(_then_trim, call)
        except BaseException:
            slots.release()
            raise
        loop = asyncio.get_running_loop()

        def free_slot(_: Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(slots.release)

        fut.add_done_callback(free_slot)
        return await asyncio.wrap_future(fut)

    def close(self) -> None:
        pool, self._executor = self._executor, None
        self._large_slots = None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _then_trim(call: Callable[[], T]) -> T:
    try:
        return call()
    finally:
        trim_native_heap()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return fn


def trim_native_heap() -> None:
    """Return the free memory of the C heap to the OS (glibc only; else nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
