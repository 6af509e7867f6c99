"""The launcher of ``pdserve launch TOPOLOGY.yaml``: start an xPyD topology, watch it,
stop it cleanly (the command line is :mod:`pdserve.serving.launch.cli`).

Lifecycle of a ``Launcher``:

1. ``start()`` makes the log dir, starts every instance at once (each a
   ``pdserve serve`` process in its own process group, stdout+stderr to
   ``<log_dir>/<name>.log``, overwritten on each launch) after checking that no port is
   taken already, waits until each answers ``GET /health`` with 200 within its
   ``startup_timeout``, then starts the proxy and waits for it the same way. It then
   prints the endpoint table and writes ``<log_dir>/launch.json`` (name, role, url,
   devices, pid, log of every process). A child that exits or times out during start-up
   stops everything and raises ``LaunchError`` with the child's last log lines;
   ``request_stop()`` during start-up stops everything and raises ``LaunchAborted``.
2. ``wait()`` blocks until ``request_stop()`` (``cli.main`` wires SIGINT/SIGTERM/SIGHUP to it)
   or until a child dies. A death is logged with the child's last log lines; with
   ``on_failure: stop`` the rest is stopped and ``wait`` returns 1, with ``keep`` the
   rest keeps running (1 once none is left). A requested stop returns 0.
3. ``stop()`` (idempotent; also run by ``wait`` and on start-up failure): SIGTERM to the
   proxy, then to every instance at once. SIGTERM goes to the group leader only (the API
   server, which drains and then stops its own engine core); once a leader has exited,
   whatever is left in its group gets SIGTERM too. Each group gets ``grace_period``
   seconds in all, then the whole process group gets SIGKILL. A second
   ``request_stop()`` skips the grace period.

Orphans: children are started in their own session (so a terminal's Ctrl-C reaches only
the launcher, which stops them in order), and on Linux with ``PR_SET_PDEATHSIG`` =
SIGTERM, so if the launcher itself dies they are told to stop (the API server then
stops its engine core, which also watches its parent). PDEATHSIG fires when the
*thread* that started the child ends: call ``start()`` from a thread that outlives the
topology (the main thread in ``cli.main``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TextIO

from pdserve.serving.launch.topology import PROXY_CMD, SERVE_CMD, ProcessSpec, Topology
from pdserve.serving.net import bind_tcp

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_TAIL_LINES = 20
_HEALTH_TIMEOUT_S = 2.0
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class LaunchError(RuntimeError):
    """The topology could not be brought up; everything started has been stopped."""


class LaunchAborted(LaunchError):
    """A stop was requested during start-up; everything started has been stopped."""


# -- child processes ----------------------------------------------------------------------


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # loaded in the parent: no dlopen between fork and exec


def _die_with_parent(prctl: Callable[..., int], parent_pid: int) -> None:
    """Runs in the child between fork and exec: SIGTERM us when the launcher dies."""
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in process group ``pgid``."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _check_port_free(spec: ProcessSpec) -> None:
    """Refuse a port something already listens on: its /health would pass for ours.
    The check binds the way the servers will (:func:`~pdserve.serving.net.bind_tcp`)."""
    try:
        bind_tcp(spec.host, spec.port).close()
    except OSError as e:
        raise LaunchError(
            f"{spec.name}: cannot use {spec.host}:{spec.port} ({e.strerror}); "
            "is an earlier launch still running?"
        ) from e


def _healthy(url: str) -> bool:
    try:
        with _NO_PROXY.open(f"{url}/health", timeout=_HEALTH_TIMEOUT_S) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Child:
    """A started process of the plan. The launcher owns it and its log file handle."""

    def __init__(self, spec: ProcessSpec) -> None:
        self.spec = spec
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = open(spec.log_file, "wb")  # noqa: SIM115 (closed in close())
        preexec = functools.partial(_die_with_parent, _PRCTL, os.getpid()) if _PRCTL else None
        try:
            self.popen = subprocess.Popen(
                spec.cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **spec.env},
                start_new_session=True,
                preexec_fn=preexec,  # prctl only: safe between fork and exec
            )
        except OSError as e:
            self._log.close()
            raise LaunchError(f"{spec.name}: cannot start {spec.cmd[0]!r}: {e}") from e
        self.started_at = time.monotonic()
        self.ready_after: float | None = None
        self.death_reported = False

    @property
    def pid(self) -> int:
        return int(self.popen.pid)

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def tail(self, n: int = _TAIL_LINES) -> str:
        """The last ``n`` lines of the log, indented for an error message."""
        self._log.flush()
        try:
            lines = self.spec.log_file.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return "    (log unreadable)"
        return "\n".join("    " + ln for ln in lines) or "    (log is empty)"

    def describe_exit(self, code: int) -> str:
        how = f"signal {-code}" if code < 0 else f"code {code}"
        return (
            f"{self.spec.name} (pid {self.pid}) exited with {how}; last lines of "
            f"{self.spec.log_file}:\n{self.tail()}"
        )

    def close(self) -> None:
        self._log.close()


# -- the launcher -------------------------------------------------------------------------


class Launcher:
    """Runs one topology: ``start()``, ``wait()`` or ``stop()``; see the module docstring.

    ``serve_cmd``/``proxy_cmd`` replace the argv prefix of the instances/proxy (a test
    may run stand-ins); ``log_dir`` overrides the topology's ``log_dir``.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        log_dir: str | Path | None = None,
        serve_cmd: Sequence[str] = SERVE_CMD,
        proxy_cmd: Sequence[str] = PROXY_CMD,
        out: TextIO | None = None,
        poll_interval: float = 0.2,
    ) -> None:
        self.topology = topology
        self._log_dir_arg = log_dir if log_dir is not None else topology.log_dir
        self._serve_cmd = tuple(serve_cmd)
        self._proxy_cmd = tuple(proxy_cmd)
        self._out = out
        self._poll = poll_interval
        self.log_dir: Path | None = None
        self.children: list[Child] = []
        self._stop_requested = threading.Event()
        self._force = threading.Event()
        self._started = False
        self._stopped = False

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise RuntimeError("Launcher.start() may be called once")
        self._started = True
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
        for spec in specs:
            _check_port_free(spec)
        try:
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
        """Block until a stop is requested (0) or a child dies (1); everything is stopped."""
        if not self.children:
            raise RuntimeError("Launcher.wait() needs a successful start() first")
        code = 0
        while not self._stop_requested.wait(self._poll):
            if self._check_deaths():
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
        self._terminate([c for c in self.children if c.spec.role == "proxy"])
        self._terminate([c for c in self.children if c.spec.role != "proxy"])
        for c in self.children:
            c.close()

    def __enter__(self) -> Launcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals -------------------------------------------------------------------------

    def _start_and_wait(self, specs: list[ProcessSpec]) -> None:
        started = []
        for spec in specs:
            logger.info("starting %s on %s (devices %s)", spec.name, spec.url, spec.devices)
            child = Child(spec)
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
                if _healthy(c.spec.url):
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

    def _check_deaths(self) -> bool:
        """Log newly dead children; True when the launcher should stop with an error."""
        for c in self.children:
            code = c.exit_code()
            if code is None or c.death_reported:
                continue
            c.death_reported = True
            logger.error("%s", c.describe_exit(code))
            if self.topology.on_failure == "stop":
                logger.error("on_failure is stop: stopping the rest of the topology")
                return True
        if all(c.exit_code() is not None for c in self.children):
            logger.error("every process has exited")
            return True
        return False

    def _terminate(self, group: list[Child]) -> None:
        for c in group:
            if c.exit_code() is None:
                logger.info("stopping %s (pid %d)", c.spec.name, c.pid)
                with contextlib.suppress(ProcessLookupError):
                    c.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.topology.grace_period
        left = list(group)
        told: set[int] = set()
        while left and time.monotonic() < deadline and not self._force.is_set():
            left = [c for c in left if c.exit_code() is None or _group_alive(c.pid)]
            for c in left:
                if c.exit_code() is not None and c.pid not in told:
                    told.add(c.pid)  # the leader is gone: ask the rest of its group to go too
                    _killpg(c.pid, signal.SIGTERM)
            if left:
                time.sleep(0.05)
        for c in left:
            if c.exit_code() is None:
                logger.warning(
                    "%s did not exit in %gs: SIGKILL", c.spec.name, self.topology.grace_period
                )
            _killpg(c.pid, signal.SIGKILL)
        for c in group:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.popen.wait(timeout=10)
            _killpg(c.pid, signal.SIGKILL)  # anything the leader left behind in its group

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
                    "log": str(c.spec.log_file),
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
