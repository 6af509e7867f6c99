"""Upstream instances of the P/D proxy: URL validation, load-aware choice, health polling.

Invariants:

* an :class:`InstancePool` is fixed at build time (no instances come or go); its
  instances' ``in_flight`` counts only legs sent through this proxy and is restored by
  the :meth:`InstancePool.lease` context manager on every exit path;
* ``healthy`` starts ``False`` until the first health poll answers (the app runs one
  round at startup); it becomes ``False`` on a failed poll or a connection error seen
  by a leg, and ``True`` again on the next poll that answers 200;
* all state is touched only from the event loop that serves the app (no locks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

logger = logging.getLogger(__name__)


def normalize_url(raw: str, *, what: str) -> str:
    """``http://host:port[/prefix]`` without a trailing slash; ``host:port`` gets ``http://``.

    Raises ``ValueError`` with a message naming ``what`` (e.g. ``"--prefill"``).
    """
    text = raw.strip()
    if not text:
        raise ValueError(f"{what}: empty URL")
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{what}: {raw!r} must be an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError(f"{what}: {raw!r} has no host")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError as e:
        raise ValueError(f"{what}: {raw!r} has an invalid port ({e})") from None
    if parts.query or parts.fragment:
        raise ValueError(f"{what}: {raw!r} must not have a query or fragment")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def normalize_urls(raws: Iterable[str], *, what: str) -> list[str]:
    """Normalised URLs of one pool; at least one, no duplicates."""
    urls = [normalize_url(r, what=what) for r in raws]
    if not urls:
        raise ValueError(f"{what}: at least one instance URL is required")
    seen: set[str] = set()
    for url in urls:
        if url in seen:
            raise ValueError(f"{what}: {url} is listed twice")
        seen.add(url)
    return urls


@dataclass
class Instance:
    """One upstream API server. ``url`` is normalised and is the metrics label."""

    url: str
    healthy: bool = False
    in_flight: int = 0


GaugeHook = Callable[[str, int], None]
HealthHook = Callable[[str, bool], None]


class InstancePool:
    """The instances of one role (``"prefill"`` or ``"decode"``).

    :meth:`pick` returns the healthy instance with the fewest in-flight legs; ties are
    broken round-robin (the scan starts after the instance picked last), so equal load
    spreads evenly.
    """

    def __init__(
        self,
        role: str,
        urls: Sequence[str],
        *,
        on_in_flight: GaugeHook | None = None,
        on_health: HealthHook | None = None,
    ) -> None:
        if not urls:
            raise ValueError(f"{role} pool needs at least one instance")
        self.role = role
        self.instances = [Instance(u) for u in urls]
        self._next = 0
        self._on_in_flight = on_in_flight
        self._on_health = on_health

    def __len__(self) -> int:
        return len(self.instances)

    @property
    def num_healthy(self) -> int:
        return sum(1 for i in self.instances if i.healthy)

    def get(self, url: str) -> Instance:
        for inst in self.instances:
            if inst.url == url:
                return inst
        raise KeyError(url)

    def pick(self, exclude: Iterable[str] = ()) -> Instance | None:
        """Least-loaded healthy instance not in ``exclude`` (URLs), or ``None``."""
        skip = set(exclude)
        n = len(self.instances)
        best: Instance | None = None
        best_pos = 0
        for k in range(n):
            pos = (self._next + k) % n
            inst = self.instances[pos]
            if not inst.healthy or inst.url in skip:
                continue
            if best is None or inst.in_flight < best.in_flight:
                best, best_pos = inst, pos
        if best is not None:
            self._next = (best_pos + 1) % n
        return best

    @contextlib.contextmanager
    def lease(self, inst: Instance) -> Iterator[Instance]:
        """Count one leg in flight on ``inst`` for the duration of the block."""
        inst.in_flight += 1
        self._report_in_flight(inst)
        try:
            yield inst
        finally:
            inst.in_flight -= 1
            self._report_in_flight(inst)

    def set_healthy(self, inst: Instance, healthy: bool, reason: str = "") -> None:
        if inst.healthy != healthy:
            if healthy:
                logger.info("%s instance %s is healthy", self.role, inst.url)
            else:
                why = f": {reason}" if reason else ""
                logger.warning("%s instance %s is unhealthy%s", self.role, inst.url, why)
        inst.healthy = healthy
        if self._on_health is not None:
            self._on_health(inst.url, healthy)

    def _report_in_flight(self, inst: Instance) -> None:
        if self._on_in_flight is not None:
            self._on_in_flight(inst.url, inst.in_flight)


class HealthChecker:
    """Polls ``GET {url}/health`` of every instance of the given pools.

    Lifecycle: :meth:`check_all` runs one round (all instances concurrently, each bounded
    by ``timeout``); :meth:`start` spawns the loop task that runs a round every
    ``interval`` seconds; :meth:`stop` cancels it and waits for it. An instance is
    healthy iff its ``/health`` answered 200 within ``timeout``.
    """

    def __init__(
        self,
        pools: Sequence[InstancePool],
        session_getter: Callable[[], aiohttp.ClientSession],
        *,
        interval: float,
        timeout: float,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"health interval must be > 0 seconds, got {interval}")
        if timeout <= 0:
            raise ValueError(f"health timeout must be > 0 seconds, got {timeout}")
        self.pools = list(pools)
        self._session = session_getter
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._task: asyncio.Task[None] | None = None

    async def check_all(self) -> None:
        await asyncio.gather(
            *(self._check(pool, inst) for pool in self.pools for inst in pool.instances)
        )

    async def _check(self, pool: InstancePool, inst: Instance) -> None:
        try:
            async with self._session().get(inst.url + "/health", timeout=self.timeout) as r:
                ok, why = r.status == 200, f"/health answered {r.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            ok, why = False, f"/health failed: {type(e).__name__}: {e}".rstrip(": ")
        pool.set_healthy(inst, ok, "" if ok else why)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="pdserve-proxy-health")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check_all()
            except Exception:  # never let the poller die; the next round retries
                logger.exception("health poll failed")
