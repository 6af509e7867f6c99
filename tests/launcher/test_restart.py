"""``on_failure: restart`` (the default) on stand-in processes: back-off, the limit, a
restart that never comes up, and restarting instances and the proxy after SIGKILL."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.serving.launch.launcher import Launcher

from .conftest import free_ports, marked_pids, pids_alive, wait_until
from .test_supervision import events, launcher, topo

pytestmark = pytest.mark.timeout(120)


def starts(tmp_path: Path, kind: str, port: int) -> list[dict[str, Any]]:
    """Every ``start`` event of one fake (one per run)."""
    lines = (tmp_path / "rec" / f"{kind}-{port}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "start"]


def run_wait(la: Launcher) -> tuple[threading.Thread, list[int]]:
    """``la.wait()`` in a thread (it outlives every restart: PDEATHSIG is per thread)."""
    result: list[int] = []
    th = threading.Thread(target=lambda: result.append(la.wait()))
    th.start()
    return th, result


def test_default_is_restart_with_backoff_then_stop_past_the_limit(
    tmp_path: Path, marker: str, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = free_ports(2)
    t = topo(
        tmp_path,
        marker,
        [
            {"role": "colocated", "port": a, "devices": "cpu", "env": {"FAKE_EXIT_AFTER": "0.3"}},
            {"role": "colocated", "port": b, "devices": "cpu"},
        ],
        restart={"max_restarts": 3, "window": 60, "backoff": 0.2, "max_backoff": 0.5},
    )
    assert t.on_failure == "restart"
    la = launcher(t)
    la.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="pdserve.serving.launch.launcher"):
        assert la.wait() == 1  # the 4th death is past max_restarts: stop everything
    took = time.monotonic() - t0
    runs = starts(tmp_path, "serve", a)
    assert len(runs) == 4  # the first run and three restarts
    # each run lives 0.3 s, then waits its back-off: 0.2, 0.4, then 0.5 (max_backoff)
    for k, delay in enumerate([0.2, 0.4, 0.5]):
        gap = runs[k + 1]["t"] - runs[k]["t"]
        assert 0.3 + delay - 0.05 < gap < 0.3 + delay + 1.5, (k, gap)
    assert took < 10
    assert "restarting colocated-0 in 0.2s (restart 1 of at most 3" in caplog.text
    assert "restarting colocated-0 in 0.5s (restart 3 of at most 3" in caplog.text
    assert "died after 3 restart(s) within 60s (restart.max_restarts: 3): giving up" in caplog.text
    log = (tmp_path / "logs" / "colocated-0.log").read_text()
    assert log.count("fake serve on") == 4 and "=== pdserve launch: restart 3 at" in log
    assert "term" in events(tmp_path, "serve", b)  # then the rest was stopped
    assert marked_pids(marker) == []


def test_killed_instance_and_proxy_come_back(tmp_path: Path, marker: str) -> None:
    p0, d0, px = free_ports(3)
    t = topo(
        tmp_path,
        marker,
        [
            {"role": "prefill", "port": p0, "devices": "cpu"},
            {"role": "decode", "port": d0, "devices": "cpu"},
        ],
        kv_transfer={"connector": "PdConnector"},
        proxy={"port": px},
        restart={"backoff": 0.2},
    )
    la = launcher(t)
    la.start()
    th, result = run_wait(la)
    try:
        for name, kind, port in (("decode-0", "serve", d0), ("proxy", "proxy", px)):
            child = next(c for c in la.children if c.spec.name == name)
            os.kill(child.pid, signal.SIGKILL)
            wait_until(lambda p=port, k=kind: len(starts(tmp_path, k, p)) == 2, 10, "a restart")
            wait_until(lambda n=name: _current(la, n).ready, 10, f"{name} to be ready again")
            new = _current(la, name)
            assert new.pid != child.pid and new.restart == 1
            first, again = starts(tmp_path, kind, port)
            assert again["argv"] == first["argv"]  # the same command, port and all
            assert again["env"]["PDSERVE_PD_SECRET"] == first["env"]["PDSERVE_PD_SECRET"]
            state = json.loads((tmp_path / "logs" / "launch.json").read_text())
            entry = next(p for p in state["processes"] if p["name"] == name)
            assert (entry["pid"], entry["restarts"]) == (new.pid, 1)
        assert th.is_alive()  # still supervising
        assert pids_alive([c.pid for c in la.children]) == [c.pid for c in la.children]
    finally:
        la.request_stop()
        th.join(30)
    assert result == [0]
    assert marked_pids(marker) == []


def _current(la: Launcher, name: str) -> Any:
    return next(c for c in la.children if c.spec.name == name)


def test_a_restart_that_never_comes_up_counts_as_a_death(
    tmp_path: Path, marker: str, caplog: pytest.LogCaptureFixture
) -> None:
    (a,) = free_ports(1)
    env = {"FAKE_RESTART_READY_DELAY": "100"}
    t = topo(
        tmp_path,
        marker,
        [{"role": "colocated", "port": a, "devices": "cpu", "env": env, "startup_timeout": 0.5}],
        restart={"max_restarts": 2, "backoff": 0.1},
    )
    la = launcher(t)
    la.start()
    th, result = run_wait(la)
    try:
        os.kill(la.children[0].pid, signal.SIGKILL)
        with caplog.at_level(logging.ERROR, logger="pdserve.serving.launch.launcher"):
            th.join(30)
    finally:
        la.request_stop()
        th.join(30)
    assert result == [1]
    assert len(starts(tmp_path, "serve", a)) == 3  # the first run and two restarts
    assert "did not answer GET" in caplog.text and "within 0.5s after its restart" in caplog.text
    assert "giving up" in caplog.text
    assert marked_pids(marker) == []
