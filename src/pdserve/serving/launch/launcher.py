"""The launcher of ``pdserve launch TOPOLOGY.yaml``: start an xPyD topology, watch it,
restart what dies, stop it cleanly (the command line is :mod:`pdserve.serving.launch.cli`;
child processes are :mod:`pdserve.serving.launch.children`).

Lifecycle of a ``Launcher``:

1. ``start()`` makes the log dir, picks the topology's P/D secret (the launcher's own
   ``PDSERVE_PD_SECRET`` if set, else a new one), starts every instance at once (each
   a ``pdserve serve`` process in its own process group, stdout+stderr to
   ``<log_dir>/<name>.log``, overwritten on each launch, with the secret in its
   environment) after checking that no port is taken already, waits until each
   answers ``GET /health`` with 200 within its ``startup_timeout``, then starts the
   proxy and waits for it the same way. It then prints the endpoint table and writes
   ``<log_dir>/launch.json`` (name, role, url, devices, pid, restarts, log of every
   process; rewritten after each restart). A child that exits or times out during
   start-up stops everything and raises ``LaunchError`` with the child's last log
   lines; ``request_stop()`` during start-up stops everything and raises
   ``LaunchAborted``.
2. ``wait()`` blocks until ``request_stop()`` (``cli.main`` wires SIGINT/SIGTERM/SIGHUP to
   it) or until the topology fails. A child's death is logged with its last log lines,
   then ``on_failure`` decides (see :mod:`pdserve.serving.launch.topology`):
   ``restart`` (the default) SIGTERMs what is left of its process group, waits the
   back-off, SIGKILLs any leftover and starts it again (log appended), then watches
   it come up (a restart that does not answer ``/health`` within ``startup_timeout``
   is killed and counts as another death); past ``restart.max_restarts`` restarts
   within ``restart.window`` seconds it gives up and, like ``stop``, stops the rest
   and returns 1. ``keep`` lets the rest run (1 once none is left). A requested stop
   returns 0.
3. ``stop()`` (idempotent; also run by ``wait`` and on start-up failure): SIGTERM to the
   proxy, then to every instance at once. SIGTERM goes to the group leader only (the API
   server, which drains and then stops its own engine core); once a leader has exited,
   whatever is left in its group gets SIGTERM too. Each group gets ``grace_period``
   seconds in all, then the whole process group gets SIGKILL. A second
   ``request_stop()`` skips the grace period.

The secret travels only in the children's environment: never on a command line, in
``launch.json``, in a log line or in ``--dry-run`` output.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pdserve.core_types.pd_auth import SECRET_ENV, load_secret, new_secret
from pdserve.serving.launch.children import (
    Child,
    LaunchAborted,
    LaunchError,
    check_port_free,
    healthy,
)
from pdserve.serving.launch.ray_placement import RayChild, RayPlacement
from pdserve.serving.launch.topology import PROXY_CMD, ProcessSpec, Topology

__all__ = ["Launcher", "LaunchError", "LaunchAborted", "topology_secret"]

logger = logging.getLogger(__name__)


def topology_secret(env: dict[str, str] | None = None) -> str:
    """The launcher's own ``PDSERVE_PD_SECRET`` if set (checked), else a new one."""
    env = dict(os.environ) if env is None else env
    try:
        inherited = load_secret(env)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    return inherited.decode() if inherited is not None else new_secret()


@dataclass
class _Restart:
    """A restart of ``children[index]``, due at ``at`` (``time.monotonic()``)."""

    index: int
    at: float


class Launcher:
    """Runs one topology: ``start()``, ``wait()`` or ``stop()``; see the module docstring.

    ``serve_cmd``/``proxy_cmd`` replace the argv prefix of the instances/proxy (a test
    may run stand-ins); ``log_dir`` overrides the topology's ``log_dir``. Under
    ``placement: {backend: ray}`` the instances run on Ray nodes
    (:mod:`pdserve.serving.launch.ray_placement`); the proxy stays a local child.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        log_dir: str | Path | None = None,
        serve_cmd: Sequence[str] | None = None,
        proxy_cmd: Sequence[str] = PROXY_CMD,
        out: TextIO | None = None,
        poll_interval: float = 0.2,
    ) -> None:
        self.topology = topology
        self._log_dir_arg = log_dir if log_dir is not None else topology.log_dir
        self._serve_cmd = tuple(serve_cmd) if serve_cmd is not None else None
        self._proxy_cmd = tuple(proxy_cmd)
        self._out = out
        self._poll = poll_interval
        self.log_dir: Path | None = None
        self.children: list[Child | RayChild] = []  # the current run of each process
        self._retired: list[Child | RayChild] = []  # earlier runs of restarted processes
        self.ray: RayPlacement | None = None
        self._restarts: dict[str, deque[float]] = {}  # name -> recent restart times
        self._pending: dict[int, _Restart] = {}
        self._child_env: dict[str, str] = {}
        self._stop_requested = threading.Event()
        self._force = threading.Event()
        self._started = False
        self._stopped = False

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise RuntimeError("Launcher.start() may be called once")
        self._started = True
        if self.topology.placement.ray:
            self.ray = RayPlacement(self.topology.placement)  # no ray: LaunchError here
        if self._log_dir_arg is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="pdserve-launch-"))
        else:
            self.log_dir = Path(self._log_dir_arg).expanduser().resolve()
            self.log_dir.mkdir(parents=True, exist_ok=True)
        specs = self.topology.plan(
            self.log_dir, serve_cmd=self._serve_cmd, proxy_cmd=self._proxy_cmd
        )
        for w in self.topology.warnings:
            logger.warning("%s", w)
        logger.info("logs in %s", self.log_dir)
        if self.ray is None:
            for spec in specs:
                check_port_free(spec)
        self._child_env = {SECRET_ENV: topology_secret()}
        try:
            if self.ray is not None:
                specs = self._place(specs)
            instances = [s for s in specs if s.role != "proxy"]
            proxy = [s for s in specs if s.role == "proxy"]
            self._start_and_wait(instances)
            self._start_and_wait(proxy)
        except BaseException:
            self.stop()
            raise
        self._write_state()
        self._print(self.endpoint_table())

    def wait(self) -> int:
        """Block until a stop is requested (0) or the topology fails (1); everything is
        stopped when it returns."""
        if not self.children:
            raise RuntimeError("Launcher.wait() needs a successful start() first")
        code = 0
        while not self._stop_requested.wait(self._poll):
            if self._supervise():
                code = 1
                break
        if code == 0:
            logger.info("stopping the topology")
        self.stop()
        return code

    def request_stop(self) -> None:
        """Ask ``start``/``wait`` to stop (safe from a signal handler); twice: no grace."""
        if self._stop_requested.is_set():
            self._force.set()
        self._stop_requested.set()

    def stop(self) -> None:
        """Proxy first, then instances: SIGTERM, ``grace_period``, SIGKILL the group."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_requested.set()
        self._pending.clear()
        self._terminate([c for c in self.children if c.spec.role == "proxy"])
        self._terminate([c for c in self.children if c.spec.role != "proxy"])
        for c in self.children + self._retired:
            c.close()
        if self.ray is not None:
            self.ray.close()

    def __enter__(self) -> Launcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals -------------------------------------------------------------------------

    def _place(self, specs: list[ProcessSpec]) -> list[ProcessSpec]:
        """Under Ray: place every instance process, then the plan with their nodes."""
        assert self.ray is not None and self.log_dir is not None
        for spec in specs:
            if spec.role == "proxy":
                check_port_free(spec)
        self.ray.connect()
        nodes = self.ray.place(
            [s for s in specs if s.role != "proxy"], stop=self._stop_requested.is_set
        )
        specs = self.topology.plan(
            self.log_dir, serve_cmd=self._serve_cmd, proxy_cmd=self._proxy_cmd, nodes=nodes
        )
        for spec in specs:
            if spec.role != "proxy":
                self.ray.check_port(spec)
        return specs

    def _new_child(self, spec: ProcessSpec, restart: int = 0) -> Child | RayChild:
        if self.ray is not None and spec.role != "proxy":
            return self.ray.child(spec, self._child_env, restart)
        return Child(spec, self._child_env, restart=restart)

    def _start_and_wait(self, specs: list[ProcessSpec]) -> None:
        started = []
        for spec in specs:
            logger.info("starting %s on %s (devices %s)", spec.name, spec.url, spec.devices)
            child = self._new_child(spec)
            self.children.append(child)
            started.append(child)
        pending = list(started)
        while pending:
            if self._stop_requested.is_set():
                raise LaunchAborted("stop requested during start-up; everything was stopped")
            for c in list(pending):
                code = c.exit_code()
                if code is not None:
                    c.death_reported = True
                    raise LaunchError(f"start-up failed: {c.describe_exit(code)}")
                elapsed = time.monotonic() - c.started_at
                if healthy(c.spec.url):
                    c.ready_after = elapsed
                    logger.info("%s is ready after %.1fs", c.spec.name, elapsed)
                    pending.remove(c)
                elif elapsed > c.spec.startup_timeout:
                    raise LaunchError(
                        f"start-up failed: {c.spec.name} (pid {c.pid}) did not answer "
                        f"GET {c.spec.url}/health with 200 within "
                        f"{c.spec.startup_timeout:g}s (startup_timeout); last lines of "
                        f"{c.spec.log_file}:\n{c.tail()}"
                    )
            if pending:
                self._stop_requested.wait(self._poll)

    def _supervise(self) -> bool:
        """One round of watching: notice deaths and restarted children coming up, start
        due restarts. True when the topology has failed (the caller stops the rest)."""
        now = time.monotonic()
        for i, c in enumerate(self.children):
            if i in self._pending or c.death_reported:
                continue
            code = c.exit_code()
            if code is None and not c.ready:
                code = self._watch_restarted(c, now)
            if code is None:
                continue
            c.death_reported = True
            logger.error("%s", c.describe_exit(code))
            policy = self.topology.on_failure
            if policy == "stop":
                logger.error("on_failure is stop: stopping the rest of the topology")
                return True
            if policy == "restart" and not self._schedule_restart(i, c, now):
                return True
        for i, r in sorted(self._pending.items()):
            if now >= r.at and not self._stop_requested.is_set():
                del self._pending[i]
                if not self._restart(i):
                    return True
        if not self._pending and all(c.exit_code() is not None for c in self.children):
            logger.error("every process has exited")
            return True
        return False

    def _watch_restarted(self, c: Child | RayChild, now: float) -> int | None:
        """A restarted child still coming up: mark it ready once healthy; past its
        ``startup_timeout`` kill it and return its exit code (a death)."""
        if healthy(c.spec.url):
            c.ready_after = now - c.started_at
            logger.info("%s is ready again after %.1fs", c.spec.name, c.ready_after)
            return None
        if now - c.started_at <= c.spec.startup_timeout:
            return None
        logger.error(
            "%s (pid %d) did not answer GET %s/health with 200 within %gs after its restart",
            c.spec.name,
            c.pid,
            c.spec.url,
            c.spec.startup_timeout,
        )
        c.kill_group(signal.SIGKILL)
        code = c.wait(10)
        return code if code is not None else -signal.SIGKILL

    def _schedule_restart(self, i: int, c: Child | RayChild, now: float) -> bool:
        """Plan the restart of a dead child after its back-off; False past the limit."""
        policy = self.topology.restart
        recent = self._restarts.setdefault(c.spec.name, deque())
        while recent and now - recent[0] > policy.window:
            recent.popleft()
        if len(recent) >= policy.max_restarts:
            logger.error(
                "%s died after %d restart(s) within %gs (restart.max_restarts: %d): giving up; "
                "stopping the rest of the topology",
                c.spec.name,
                len(recent),
                policy.window,
                policy.max_restarts,
            )
            return False
        delay = policy.delay(len(recent))
        c.kill_group(signal.SIGTERM)  # what is left of its group (an engine core) goes
        self._pending[i] = _Restart(i, now + delay)
        logger.warning(
            "on_failure is restart: restarting %s in %.1fs (restart %d of at most %d within %gs)",
            c.spec.name,
            delay,
            len(recent) + 1,
            policy.max_restarts,
            policy.window,
        )
        return True

    def _restart(self, i: int) -> bool:
        """Start ``children[i]`` again; False when that failed past the restart limit."""
        old = self.children[i]
        old.kill_group(signal.SIGKILL)  # anything of the dead run still in its group
        recent = self._restarts.setdefault(old.spec.name, deque())
        recent.append(time.monotonic())
        try:
            new: Child | RayChild | None = self._new_child(old.spec, old.restart + 1)
        except LaunchError as e:
            logger.error("%s", e)
            new = None
        if new is None:  # it could not even start: a death again, with its back-off
            return self._schedule_restart(i, old, time.monotonic())
        self._retired.append(old)
        self.children[i] = new
        logger.info("restarted %s (pid %d, restart %d)", new.spec.name, new.pid, new.restart)
        self._write_state()
        return True

    def _terminate(self, group: list[Child | RayChild]) -> None:
        for c in group:
            if c.exit_code() is None:
                logger.info("stopping %s (pid %d)", c.spec.name, c.pid)
                c.terminate()
        deadline = time.monotonic() + self.topology.grace_period
        left = list(group)
        told: set[str] = set()
        while left and time.monotonic() < deadline and not self._force.is_set():
            left = [c for c in left if c.exit_code() is None or c.group_alive()]
            for c in left:
                if c.exit_code() is not None and c.spec.name not in told:
                    told.add(c.spec.name)  # the leader is gone: ask the rest of its group
                    c.kill_group(signal.SIGTERM)
            if left:
                time.sleep(0.05)
        for c in left:
            if c.exit_code() is None:
                logger.warning(
                    "%s did not exit in %gs: SIGKILL", c.spec.name, self.topology.grace_period
                )
            c.kill_group(signal.SIGKILL)
        for c in group:
            c.wait(10)
            c.kill_group(signal.SIGKILL)  # anything the leader left behind in its group

    def _write_state(self) -> None:
        assert self.log_dir is not None
        state = {
            "launcher_pid": os.getpid(),
            "source": self.topology.source,
            "processes": [
                {
                    "name": c.spec.name,
                    "role": c.spec.role,
                    "url": c.spec.url,
                    "devices": c.spec.devices,
                    "pid": c.pid,
                    "restarts": c.restart,
                    "log": str(c.spec.log_file),
                    **({"node_id": c.node.node_id} if isinstance(c, RayChild) else {}),
                }
                for c in self.children
            ],
        }
        tmp = self.log_dir / "launch.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.log_dir / "launch.json")

    def endpoint_table(self) -> str:
        """The table printed once everything is ready: one row per process."""
        rows = [("ROLE", "NAME", "URL", "DEVICES", "PID", "LOG")]
        rows += [
            (c.spec.role, c.spec.name, c.spec.url, c.spec.devices, str(c.pid), str(c.spec.log_file))
            for c in self.children
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = [
            "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)) + "  " + r[-1]
            for r in rows
        ]
        proxy = next((c for c in self.children if c.spec.role == "proxy"), None)
        entry = (
            f"send requests to {proxy.spec.url}" if proxy else "no proxy: call instances directly"
        )
        lines.append(
            f"pdserve launch: {len(self.children)} process(es) ready; {entry}; "
            f"logs and launch.json in {self.log_dir}; Ctrl-C stops all"
        )
        return "\n".join(lines)

    def _print(self, text: str) -> None:
        print(text, file=self._out or sys.stdout, flush=True)
