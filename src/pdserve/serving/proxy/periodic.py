"""A background task of the proxy that runs one coroutine every ``interval`` seconds:
:meth:`Periodic.start` in the app's lifespan startup, :meth:`Periodic.stop` at shutdown.
A round that raises is logged and the next one runs: no periodic chore may take the proxy
down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class Periodic:
    """``await fn()`` every ``interval`` seconds (the first round at once, or after one
    interval with ``wait_first``)."""

    def __init__(
        self,
        name: str,
        interval: float,
        fn: Callable[[], Awaitable[None]],
        *,
        wait_first: bool = False,
    ) -> None:
        self.name = name
        self.interval = interval
        self.fn = fn
        self.wait_first = wait_first
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"pdserve-{self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        if self.wait_first:
            await asyncio.sleep(self.interval)
        while True:
            try:
                await self.fn()
            except Exception:
                logger.exception("%s failed", self.name)
            await asyncio.sleep(self.interval)
