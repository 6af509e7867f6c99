"""Upstream instances of the P/D proxy: URL validation, load-aware choice, health state,
and the guards that tie a leg's life to its instance's health.

Invariants:

* an :class:`InstancePool` is fixed at build time (no instances come or go); its
  instances' ``in_flight`` counts only legs sent through this proxy and is restored by
  the :meth:`InstancePool.lease` context manager on every exit path;
* ``healthy`` starts ``False`` until the first health probe answers 200 (the app runs
  one round at startup). A healthy instance is marked down after ``failure_threshold``
  *consecutive* failures (default 3: probes that time out or cannot connect, legs that
  cannot connect or whose connection breaks); any success (a probe's 200, any HTTP
  answer to a leg) resets the count. A probe answered with another status marks it
  down at once (the instance says it is not ready, e.g. while it drains). Only a probe
  that answers 200 brings it back, and each return increments ``generation``;
* marking an instance down fails every leg in flight on it at once (each leg runs
  inside :meth:`InstancePool.guard`), so a hung instance holds its legs for about
  ``failure_threshold`` probe periods, not for the leg timeout;
* all state is touched only from the event loop that serves the app (no locks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from urllib.parse import urlsplit

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


DEFAULT_FAILURE_THRESHOLD = 3


@dataclass(eq=False)
class Instance:
    """One upstream API server. ``url`` is normalised and is the metrics label."""

    url: str
    healthy: bool = False
    in_flight: int = 0
    failures: int = 0  # consecutive failures since the last success
    generation: int = 0  # how many times it became healthy
    guards: set[LegGuard] = field(default_factory=set, repr=False)


class InstanceDown(Exception):
    """The leg's instance was marked down while the leg ran."""

    def __init__(self, url: str) -> None:
        super().__init__(f"{url} was marked down while the leg ran")
        self.url = url


class LegGuard:
    """``async with pool.guard(inst):`` runs its block until it ends or ``inst`` is marked
    down; then the block is cancelled and :class:`InstanceDown` raised in its place.

    Inside the block a ``CancelledError`` may thus come from the guard: code there that
    handles cancellation must check :attr:`fired` before treating it as a client leaving.
    """

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.fired = False
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> LegGuard:
        self._timeout = asyncio.timeout(None)
        await self._timeout.__aenter__()
        self.inst.guards.add(self)
        return self

    async def __aexit__(
        self,
        et: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.inst.guards.discard(self)
        assert self._timeout is not None
        try:
            await self._timeout.__aexit__(et, exc, tb)
        except TimeoutError:
            if self.fired:
                raise InstanceDown(self.inst.url) from None
            raise

    def fire(self) -> None:
        if not self.fired and self._timeout is not None:
            self.fired = True
            self._timeout.reschedule(asyncio.get_running_loop().time())


GaugeHook = Callable[[str, int], None]
HealthHook = Callable[[str, bool], None]


class InstancePool:
    """The instances of one role (``"prefill"`` or ``"decode"``).

    :meth:`pick` returns the healthy instance with the fewest in-flight legs; ties are
    broken round-robin (the scan starts after the instance picked last), so equal load
    spreads evenly. :meth:`wait_pick` waits (bounded) for one when none is eligible.
    """

    def __init__(
        self,
        role: str,
        urls: Sequence[str],
        *,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        on_in_flight: GaugeHook | None = None,
        on_health: HealthHook | None = None,
    ) -> None:
        if not urls:
            raise ValueError(f"{role} pool needs at least one instance")
        if failure_threshold < 1:
            raise ValueError(f"failure threshold must be >= 1, got {failure_threshold}")
        self.role = role
        self.instances = [Instance(u) for u in urls]
        self.failure_threshold = failure_threshold
        self._next = 0
        self._on_in_flight = on_in_flight
        self._on_health = on_health
        self._came_up = asyncio.Event()  # set and replaced whenever an instance comes up

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

    async def wait_pick(self, tried: dict[str, int], deadline: float) -> Instance | None:
        """:meth:`pick`, skipping the instances in ``tried`` (URL -> ``generation`` when
        tried) unless they have come back since; if none is eligible, wait for one until
        ``deadline`` (``loop.time()``), then ``None``."""
        loop = asyncio.get_running_loop()
        while True:
            inst = self.pick(self.not_back(tried))
            if inst is not None:
                return inst
            left = deadline - loop.time()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._came_up.wait()

    def not_back(self, tried: dict[str, int]) -> list[str]:
        """The URLs in ``tried`` (URL -> ``generation`` when tried) that have not come
        back since."""
        return [u for u, gen in tried.items() if self.get(u).generation == gen]

    async def wait_healthy(self, deadline: float) -> bool:
        """Wait until some instance is healthy or ``deadline`` (``loop.time()``) passes."""
        loop = asyncio.get_running_loop()
        while self.num_healthy == 0:
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._came_up.wait()
        return True

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

    def guard(self, inst: Instance) -> LegGuard:
        """See :class:`LegGuard`."""
        return LegGuard(inst)

    # -- health state ---------------------------------------------------------------
    def record_success(self, inst: Instance) -> None:
        """The instance answered: reset its failure count (it does not bring it back)."""
        inst.failures = 0

    def record_failure(self, inst: Instance, reason: str) -> None:
        """One more consecutive failure; the ``failure_threshold``-th marks it down."""
        inst.failures += 1
        if inst.healthy and inst.failures >= self.failure_threshold:
            why = f"{inst.failures} consecutive failures, the last: {reason}"
            self.set_healthy(inst, False, why)
        elif inst.healthy:
            logger.info(
                "%s instance %s: failure %d of %d before it is marked down: %s",
                self.role,
                inst.url,
                inst.failures,
                self.failure_threshold,
                reason,
            )

    def set_healthy(self, inst: Instance, healthy: bool, reason: str = "") -> None:
        """Set the state now (a probe's verdict). Going down fails the legs in flight on
        it; coming up bumps ``generation`` and wakes :meth:`wait_pick`."""
        changed = inst.healthy != healthy
        inst.healthy = healthy
        if healthy:
            inst.failures = 0
        if changed and healthy:
            inst.generation += 1
            logger.info("%s instance %s is healthy", self.role, inst.url)
            self._came_up.set()
            self._came_up = asyncio.Event()
        elif changed:
            why = f": {reason}" if reason else ""
            logger.warning("%s instance %s is unhealthy%s", self.role, inst.url, why)
            for g in list(inst.guards):
                g.fire()
        if self._on_health is not None:
            self._on_health(inst.url, healthy)

    def _report_in_flight(self, inst: Instance) -> None:
        if self._on_in_flight is not None:
            self._on_in_flight(inst.url, inst.in_flight)
