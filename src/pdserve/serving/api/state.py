"""Per-app serving state: in-flight accounting, draining, request ids, and what the
handlers share (:class:`ServingContext`). The ASGI middleware that enforces the
request-level rules is :mod:`pdserve.serving.api.middleware`.

Lifecycle of the app: SERVING → (``begin_drain``, from SIGTERM) DRAINING → stopped by
the server runner (:class:`~pdserve.serving.api.server.ApiServer`). While draining, every endpoint except
``/metrics`` answers 503 and ``/health`` reports 503, so load balancers stop routing here.

Invariants:

* ``in_flight`` counts HTTP requests (except ``/metrics`` and ``/health``) from the
  moment the middleware sees them until the app has sent the last body byte (for SSE:
  the end of the stream). ``wait_idle`` returns when it is zero.
* An engine request id is registered while its HTTP request owns it; a second request
  with the same id (``X-Request-Id``) is rejected with 400 rather than colliding in
  the engine.
* Detached tasks (engine aborts, iterator cleanup) are owned by ``_tasks`` until done,
  so they are never garbage-collected mid-flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pdserve.core_types.pd_auth import NonceCache
from pdserve.metrics.prometheus import PrometheusMetrics
from pdserve.serving.api.chat_output import OutputParsing
from pdserve.serving.api.errors import APIError
from pdserve.serving.api.workers import BlockingPool

if TYPE_CHECKING:
    from fastapi import FastAPI

    from pdserve.serving.api.chat_template import ChatTemplates
    from pdserve.serving.api.engine_client import EngineClient

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ServerState:
    """Draining flag, in-flight count and live engine request ids of one app."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._request_ids: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    # in-flight accounting (called by the middleware)
    def request_started(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no request is in flight within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, timeout))
        except TimeoutError:
            return False
        return True

    def begin_drain(self) -> None:
        self.draining = True

    # engine request ids
    def register(self, request_id: str) -> None:
        if request_id in self._request_ids:
            raise APIError(
                400,
                f"request id {request_id!r} is already used by a request in flight",
                param="X-Request-Id",
            )
        self._request_ids.add(request_id)

    def unregister(self, request_id: str) -> None:
        self._request_ids.discard(request_id)

    def active_request_ids(self) -> list[str]:
        return sorted(self._request_ids)

    # detached tasks
    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        """Run ``coro`` to completion in the background; errors are logged, not raised."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def _done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                logger.warning("%s failed: %r", what, t.exception())

        task.add_done_callback(_done)


@dataclass
class ServingContext:
    """Everything the handlers share. One per app; lives in ``app.state.pdserve``."""

    engine: EngineClient
    served_model_names: list[str]
    metrics: PrometheusMetrics
    chat: ChatTemplates
    enable_prompt_tokens_details: bool
    version: str
    state: ServerState = field(default_factory=ServerState)
    # the P/D secret kv_transfer_params must be signed with (None: refuse them all)
    pd_secret: bytes | None = None
    # nonces of the signed kv_transfer_params (and releases) accepted: a second use is refused
    pd_nonces: NonceCache = field(default_factory=NonceCache)
    # tokenizer / template work; threads started on first use, closed at lifespan end
    pool: BlockingPool = field(default_factory=BlockingPool)
    # reasoning and tool-call parsing of chat output (--reasoning-parser, ...)
    parsing: OutputParsing = field(default_factory=OutputParsing)

    @property
    def default_model(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        """The served name to report; raises 404 for a model this server does not serve."""
        if model is None or model == "":
            return self.default_model
        if model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")
        return model

    async def run_blocking(
        self, fn: Callable[..., T], *args: Any, job_size: int = 0, **kwargs: Any
    ) -> T:
        """Run tokenizer / template work off the event loop, in the bounded pool;
        ``job_size`` (characters or token ids) tells a large job from a small one."""
        return await self.pool.run(fn, *args, job_size=job_size, **kwargs)

    def abort_soon(self, request_id: str) -> None:
        """Abort an engine request without awaiting (safe inside ``finally`` under cancel)."""
        self.state.spawn(self.engine.abort(request_id), f"abort of {request_id}")

    def abort_all(self) -> int:
        ids = self.state.active_request_ids()
        for rid in ids:
            self.abort_soon(rid)
        return len(ids)

    def close(self) -> None:
        self.pool.close()


def serving_context(app: FastAPI) -> ServingContext:
    """The :class:`ServingContext` of an app made by ``pdserve.serving.api.app.build_app``."""
    ctx = getattr(app.state, "pdserve", None)
    if not isinstance(ctx, ServingContext):
        raise TypeError("app was not built by pdserve.serving.api.app.build_app")
    return ctx
