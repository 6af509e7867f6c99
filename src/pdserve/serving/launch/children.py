"""The launcher's child processes: starting one (own session, dies with the launcher),
probing it, and killing its whole process group.

Orphans: children are started in their own session (so a terminal's Ctrl-C reaches only
the launcher, which stops them in order), and on Linux with ``PR_SET_PDEATHSIG`` =
SIGTERM, so if the launcher itself dies they are told to stop (the API server then
stops its engine core, which also watches its parent). PDEATHSIG fires when the
*thread* that started the child ends, restarts included: run ``Launcher.start()`` and
``Launcher.wait()`` from a thread that outlives the topology (the main thread in
``cli.main``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import http.client
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from pdserve.serving.launch.topology import ProcessSpec
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


def group_alive(pgid: int) -> bool:
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


def killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def check_port_free(spec: ProcessSpec) -> None:
    """Refuse a port something already listens on: its /health would pass for ours.
    The check binds the way the servers will (:func:`~pdserve.serving.net.bind_tcp`)."""
    try:
        bind_tcp(spec.host, spec.port).close()
    except OSError as e:
        raise LaunchError(
            f"{spec.name}: cannot use {spec.host}:{spec.port} ({e.strerror}); "
            "is an earlier launch still running?"
        ) from e


def healthy(url: str) -> bool:
    """``GET url/health`` answered 200; False for anything else, including a port that
    answers something other than HTTP (another program listening there)."""
    try:
        with _NO_PROXY.open(f"{url}/health", timeout=_HEALTH_TIMEOUT_S) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
        return False


class Child:
    """A started process of the plan. The launcher owns it and its log file handle.

    ``extra_env`` is set on top of ``spec.env`` and never shown (the P/D secret).
    ``restart`` is how many times this process was restarted before (0: the first
    start); a restart appends to the log instead of overwriting it.
    """

    def __init__(
        self, spec: ProcessSpec, extra_env: Mapping[str, str] | None = None, restart: int = 0
    ) -> None:
        self.spec = spec
        self.restart = restart
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        # closed in close()
        self._log: IO[bytes] = open(spec.log_file, "ab" if restart else "wb")  # noqa: SIM115
        if restart:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._log.write(f"\n=== pdserve launch: restart {restart} at {stamp} ===\n".encode())
            self._log.flush()
        self._log_start = self._log.tell()
        preexec = functools.partial(_die_with_parent, _PRCTL, os.getpid()) if _PRCTL else None
        try:
            self.popen = subprocess.Popen(
                spec.cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **spec.env, **(extra_env or {})},
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

    @property
    def ready(self) -> bool:
        return self.ready_after is not None

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def tail(self, n: int = _TAIL_LINES) -> str:
        """The last ``n`` lines this run wrote to the log, indented for a message."""
        self._log.flush()
        try:
            with open(self.spec.log_file, "rb") as f:
                f.seek(self._log_start)
                lines = f.read().decode(errors="replace").splitlines()[-n:]
        except OSError:
            return "    (log unreadable)"
        return "\n".join("    " + ln for ln in lines) or "    (log is empty)"

    def describe_exit(self, code: int) -> str:
        how = f"signal {-code}" if code < 0 else f"code {code}"
        return (
            f"{self.spec.name} (pid {self.pid}) exited with {how}; last lines of "
            f"{self.spec.log_file}:\n{self.tail()}"
        )

    # -- signals: the launcher stops a child through these (a Ray-placed child has the
    # same methods, run on its node)

    def terminate(self) -> None:
        """SIGTERM to the group leader only (the API server stops its own engine core)."""
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(signal.SIGTERM)

    def kill_group(self, sig: int) -> None:
        killpg(self.pid, sig)

    def group_alive(self) -> bool:
        return group_alive(self.pid)

    def wait(self, timeout: float) -> int | None:
        """The exit code once the leader exited within ``timeout`` seconds, else None."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout)
        return self.exit_code()

    def close(self) -> None:
        self._log.close()
