"""TEST-ONLY: a deliberate memory leak in the API server, for ``pdserve soak``'s own test.

With ``PDSERVE_TEST_LEAK_BYTES_PER_REQUEST=N`` in the environment of ``pdserve serve``
(read once, when the app is built), every ``POST /v1/...`` request appends ``N`` touched
bytes to a list the app never drains, so the API process's RSS grows by about ``N``
bytes per request. ``tests/bench/test_soak_live.py`` plants it and checks that the soak
reports the leak, and that the same run without it passes.

It is refused (start-up fails) unless ``PYTEST_CURRENT_TEST`` is set as well, which
pytest does for the processes a test starts: the variable must never reach a real
deployment. Unset, it costs nothing (no middleware is added).
"""

from __future__ import annotations

import logging
import os

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

ENV = "PDSERVE_TEST_LEAK_BYTES_PER_REQUEST"
_MAX_BYTES = 1 << 20

logger = logging.getLogger(__name__)


class _LeakPlant:
    """Pure ASGI middleware that keeps ``nbytes`` per generation request forever."""

    def __init__(self, app: ASGIApp, nbytes: int) -> None:
        self.app = app
        self.nbytes = nbytes
        self.kept: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] == "http" and scope.get("method") == "POST" and path.startswith("/v1/"):
            self.kept.append(b"\xa5" * self.nbytes)  # filled, so the pages are resident
        await self.app(scope, receive, send)


def install_leak_plant(app: FastAPI) -> None:
    """Add the leak when ``PDSERVE_TEST_LEAK_BYTES_PER_REQUEST`` is set (tests only)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return
    if not os.environ.get("PYTEST_CURRENT_TEST"):
        raise ValueError(f"{ENV} is a test-only switch; it is refused outside pytest")
    try:
        nbytes = int(raw)
    except ValueError:
        nbytes = -1
    if not 1 <= nbytes <= _MAX_BYTES:
        raise ValueError(f"{ENV} must be an integer in [1, {_MAX_BYTES}], got {raw!r}")
    logger.warning("TEST-ONLY leak plant active: %d bytes kept per request (%s)", nbytes, ENV)
    app.add_middleware(_LeakPlant, nbytes=nbytes)
