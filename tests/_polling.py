"""Polling for tests that wait on another thread or process (imported by name: pytest puts
``tests/`` on the path for its root conftest)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(cond: Callable[[], bool], timeout: float = 5.0, step: float = 0.01) -> bool:
    """Poll ``cond`` every ``step`` seconds until it holds or ``timeout`` passes; returns its
    last value (one final check after the deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()
