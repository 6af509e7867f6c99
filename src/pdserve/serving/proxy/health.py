"""Health probes of the P/D proxy: ``GET {url}/health`` of every instance, on a timer.

Lifecycle of a :class:`HealthChecker`: :meth:`~HealthChecker.check_all` probes every
instance once, concurrently (the app runs it at startup, so ``/health`` is truthful
from the first request); :meth:`~HealthChecker.start` starts one probe loop per
instance, each probing every ``interval`` seconds (start to start: a probe that takes
its whole timeout delays no other instance and no later probe of its own);
:meth:`~HealthChecker.stop` cancels the loops and waits for them.

A probe is bounded by its own ``timeout`` (default 2 s), separate from the legs' long
timeouts, and goes through :meth:`~pdserve.serving.proxy.upstream.Upstream.request`, so
a stale pooled connection is retried on a new one instead of counting as a failure.
Verdicts (see :mod:`pdserve.serving.proxy.pool` for what they do): 200 is a success and
brings the instance back; another status marks it down at once; a timeout or a
connection error is one failure (``failure_threshold`` consecutive ones mark it down).
With the defaults (interval 2 s, timeout 2 s, threshold 3), an instance that hangs is
marked down, and its legs failed, 6-8 s after it stops answering (three probes that
each wait out their timeout); one that dies sooner, as legs and probes are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import aiohttp

from pdserve.serving.proxy.pool import Instance, InstancePool
from pdserve.serving.proxy.upstream import Upstream

logger = logging.getLogger(__name__)

DEFAULT_HEALTH_INTERVAL_S = 2.0
DEFAULT_HEALTH_TIMEOUT_S = 2.0


class HealthChecker:
    """Probes the instances of the given pools; see the module docstring."""

    def __init__(
        self,
        pools: Sequence[InstancePool],
        upstream: Upstream,
        *,
        interval: float = DEFAULT_HEALTH_INTERVAL_S,
        timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"health interval must be > 0 seconds, got {interval}")
        if not timeout > 0:
            raise ValueError(f"health timeout must be > 0 seconds, got {timeout}")
        self.pools = list(pools)
        self.upstream = upstream
        self.interval = interval
        self.timeout = timeout
        self._tasks: list[asyncio.Task[None]] = []

    async def check_all(self) -> None:
        await asyncio.gather(
            *(self.check(pool, inst) for pool in self.pools for inst in pool.instances)
        )

    async def check(self, pool: InstancePool, inst: Instance) -> None:
        """One probe of ``inst`` and its verdict."""
        status: int | None = None
        why = ""
        try:
            async with asyncio.timeout(self.timeout):
                resp = await self.upstream.request("GET", inst.url + "/health", instance=inst.url)
                try:
                    await resp.read()
                    status = resp.status
                finally:
                    resp.release()
        except TimeoutError:
            why = f"/health did not answer within {self.timeout:g}s"
        except (aiohttp.ClientError, OSError) as e:
            why = f"/health failed: {type(e).__name__}: {e}".rstrip(": ")
        if status == 200:
            pool.set_healthy(inst, True)
        elif status is not None:
            pool.set_healthy(inst, False, f"/health answered {status}")
        else:
            pool.record_failure(inst, why)

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._loop(pool, inst), name=f"pdserve-health {inst.url}")
                for pool in self.pools
                for inst in pool.instances
            ]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self, pool: InstancePool, inst: Instance) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.interval
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at = max(next_at + self.interval, loop.time())
            try:
                await self.check(pool, inst)
            except Exception:  # never let a probe loop die; the next round retries
                logger.exception("health probe of %s failed", inst.url)
