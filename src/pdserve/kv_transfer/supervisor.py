"""Supervision of the connector's threads: notice a dead one, restart it, report health.

The engine core calls :meth:`Supervisor.check` from its own thread (a few times a
second). A dead KV server makes the connector unhealthy at once (the API server's
``GET /health`` answers 503 from the next stats snapshot); the server is restarted on
the same port after a back-off (0.5 s, doubling on each death up to 30 s, back to
0.5 s after a minute of health), so the instance does not spin on a thread that dies
at once. Dead puller workers are restarted at once (their failed read is reported).
"""

from __future__ import annotations

import logging
import time

from pdserve.kv_transfer.base import KVHealth
from pdserve.kv_transfer.puller import KVPuller
from pdserve.kv_transfer.server import KVServer

logger = logging.getLogger(__name__)

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 30.0
STABLE_S = 60.0


class Supervisor:
    def __init__(self, server: KVServer | None, puller: KVPuller | None) -> None:
        self.server = server
        self.puller = puller
        self.restarts = 0
        self._delay = FIRST_DELAY_S
        self._down_since: float | None = None
        self._next_try = 0.0
        self._up_since = time.monotonic()
        self._reason = ""

    def check(self) -> KVHealth:
        now = time.monotonic()
        if self.server is not None:
            self._check_server(self.server, now)
        if self.puller is not None:
            for line in self.puller.supervise():
                logger.error("%s; restarted it", line)
                self.restarts += 1
        healthy = self._down_since is None
        rejected = self.server.handler.rejected if self.server is not None else {}
        return KVHealth(healthy, "" if healthy else self._reason, self.restarts, rejected)

    def _check_server(self, srv: KVServer, now: float) -> None:
        if srv.alive or srv.closed:  # (closed: the engine is shutting down)
            if now - self._up_since > STABLE_S:
                self._delay = FIRST_DELAY_S
            return
        if self._down_since is None:
            self._down_since = now
            self._next_try = now + self._delay
            self._reason = (
                f"the KV server thread on {srv.host}:{srv.port} died ({srv.death or 'no reason'})"
            )
            logger.error("%s; restarting it in %.1fs", self._reason, self._delay)
            srv.release_port()
            return
        if now < self._next_try:
            return
        self._delay = min(self._delay * 2, MAX_DELAY_S)  # the next death waits longer
        self._next_try = now + self._delay
        try:
            srv.restart()
        except Exception as e:
            self._reason = (
                f"the KV server on {srv.host}:{srv.port} is down; restarting it failed "
                f"({type(e).__name__}: {e})"
            )
            logger.error("%s; next try in %.1fs", self._reason, self._delay)
            return
        self.restarts += 1
        self._down_since = None
        self._up_since = now
