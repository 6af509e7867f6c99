"""Start-up order, stop order, escalation and failure handling, on stand-in processes.

``fake_server.py`` plays ``pdserve serve`` and ``pdserve proxy`` (it starts in ~50 ms),
so these tests exercise the launcher's supervision without loading a model.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.serving.launch.launcher import LaunchAborted, Launcher, LaunchError
from pdserve.serving.launch.topology import Topology

from .conftest import FAKE_SERVER, MARKER_VAR, free_ports, marked_pids, pids_alive, wait_until

SERVE = (sys.executable, str(FAKE_SERVER), "serve")
PROXY = (sys.executable, str(FAKE_SERVER), "proxy")


def topo(tmp_path: Path, marker: str, instances: list[dict[str, Any]], **over: Any) -> Topology:
    rec = tmp_path / "rec"
    rec.mkdir(exist_ok=True)
    d: dict[str, Any] = {
        "model": "fake-model",
        "env": {"FAKE_RECORD_DIR": str(rec), MARKER_VAR: marker},
        "grace_period": 5,
        "startup_timeout": 20,
        "log_dir": str(tmp_path / "logs"),
        "instances": instances,
    }
    d.update(over)
    return Topology.from_dict(d)


def events(tmp_path: Path, kind: str, port: int) -> dict[str, dict[str, Any]]:
    """event name -> its record (last one wins) of one fake process."""
    out = {}
    for ln in (tmp_path / "rec" / f"{kind}-{port}.jsonl").read_text().splitlines():
        e = json.loads(ln)
        out[e["event"]] = e
    return out


def launcher(t: Topology) -> Launcher:
    return Launcher(t, serve_cmd=SERVE, proxy_cmd=PROXY, out=io.StringIO(), poll_interval=0.05)


def test_pd_topology_starts_proxy_last_and_stops_it_first(tmp_path: Path, marker: str) -> None:
    p0, d0, px = free_ports(3)
    while p0 + 1 in (d0, px):
        p0, d0, px = free_ports(3)
    t = topo(
        tmp_path,
        marker,
        [
            {"role": "prefill", "port": p0, "devices": "cpu", "replicas": 2,
             "env": {"FAKE_READY_DELAY": "0.4"}},
            {"role": "decode", "port": d0, "devices": "cpu", "args": ["--max-num-seqs", 4]},
        ],
        kv_transfer={"connector": "PdConnector", "extra_config": {"transport": "tcp"}},
        proxy={"port": px},
        served_model_name="tiny",
    )  # fmt: skip
    la = launcher(t)
    la.start()
    try:
        names = [c.spec.name for c in la.children]
        assert sorted(marked_pids(marker)) == sorted(c.pid for c in la.children)
        assert names == ["prefill-0", "prefill-1", "decode-0", "proxy"]
        inst = [events(tmp_path, "serve", p) for p in (p0, p0 + 1, d0)]
        proxy = events(tmp_path, "proxy", px)
        # the proxy starts only after every instance answered /health with 200
        assert proxy["start"]["t"] > max(e["ready"]["t"] for e in inst)
        argv = proxy["start"]["argv"]
        assert argv == [
            "--prefill", f"http://127.0.0.1:{p0}", f"http://127.0.0.1:{p0 + 1}",
            "--decode", f"http://127.0.0.1:{d0}", "--host", "127.0.0.1", "--port", str(px),
        ]  # fmt: skip
        dec = inst[2]["start"]
        assert json.loads(dec["argv"][dec["argv"].index("--kv-transfer-config") + 1])[
            "kv_role"
        ] == ("kv_consumer")
        assert dec["env"]["CUDA_VISIBLE_DEVICES"] == "" and dec["env"]["PYTHONUNBUFFERED"] == "1"
        state = json.loads((tmp_path / "logs" / "launch.json").read_text())
        assert [p["pid"] for p in state["processes"]] == [c.pid for c in la.children]
        assert state["processes"][3]["url"] == f"http://127.0.0.1:{px}"
        table = la._out.getvalue()  # type: ignore[union-attr]
        assert "ROLE" in table and f"http://127.0.0.1:{px}" in table and "prefill-1.log" in table
        assert (tmp_path / "logs" / "proxy.log").read_text().startswith("fake proxy on")
    finally:
        la.stop()
    terms = [events(tmp_path, "serve", p)["term"]["t"] for p in (p0, p0 + 1, d0)]
    assert events(tmp_path, "proxy", px)["term"]["t"] < min(terms)
    assert pids_alive([c.pid for c in la.children]) == []
    assert marked_pids(marker) == []


def test_sigkill_after_grace_reaches_the_whole_group(tmp_path: Path, marker: str) -> None:
    (port,) = free_ports(1)
    env = {"FAKE_IGNORE_TERM": "1", "FAKE_GRANDCHILD": "1"}
    t = topo(
        tmp_path,
        marker,
        [{"role": "colocated", "port": port, "devices": "cpu", "env": env}],
        grace_period=0.5,
    )
    la = launcher(t)
    la.start()
    grandchild = events(tmp_path, "serve", port)["grandchild"]["pid"]
    assert pids_alive([grandchild]) == [grandchild]
    t0 = time.monotonic()
    la.stop()
    assert 0.4 < time.monotonic() - t0 < 5
    assert "term" in events(tmp_path, "serve", port)  # SIGTERM came first
    assert la.children[0].popen.returncode == -signal.SIGKILL
    wait_until(lambda: not pids_alive([grandchild]), 5, "the grandchild to die")
    assert marked_pids(marker) == []


def test_leftover_group_members_get_killed_after_a_clean_exit(tmp_path: Path, marker: str) -> None:
    (port,) = free_ports(1)
    t = topo(
        tmp_path,
        marker,
        [{"role": "colocated", "port": port, "devices": "cpu", "env": {"FAKE_GRANDCHILD": "1"}}],
        grace_period=0.5,
    )
    la = launcher(t)
    la.start()
    grandchild = events(tmp_path, "serve", port)["grandchild"]["pid"]
    assert sorted(marked_pids(marker)) == sorted([la.children[0].pid, grandchild])
    la.stop()
    assert la.children[0].popen.returncode == 0
    wait_until(lambda: marked_pids(marker) == [], 5, "no leftovers")


def test_child_death_with_on_failure_stop(
    tmp_path: Path, marker: str, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = free_ports(2)
    t = topo(
        tmp_path,
        marker,
        [
            {"role": "colocated", "port": a, "devices": "cpu", "env": {"FAKE_EXIT_AFTER": "0.5"}},
            {"role": "colocated", "port": b, "devices": "cpu"},
        ],
        on_failure="stop",
    )
    la = launcher(t)
    la.start()
    with caplog.at_level(logging.ERROR, logger="pdserve.serving.launch.launcher"):
        assert la.wait() == 1
    assert "colocated-0 (pid" in caplog.text and "exited with code 3" in caplog.text
    assert "fake serve on" in caplog.text  # the child's last log lines
    assert "term" in events(tmp_path, "serve", b)
    assert marked_pids(marker) == []


def test_child_death_with_on_failure_keep(tmp_path: Path, marker: str) -> None:
    a, b = free_ports(2)
    t = topo(
        tmp_path,
        marker,
        [
            {"role": "colocated", "port": a, "devices": "cpu", "env": {"FAKE_EXIT_AFTER": "0.3"}},
            {"role": "colocated", "port": b, "devices": "cpu"},
        ],
        on_failure="keep",
    )
    la = launcher(t)
    la.start()
    result: list[int] = []
    th = threading.Thread(target=lambda: result.append(la.wait()))
    th.start()
    try:
        wait_until(lambda: la.children[0].death_reported, 10, "the death to be noticed")
        time.sleep(0.3)
        assert la.children[1].exit_code() is None
    finally:
        la.request_stop()
        th.join(20)
    assert result == [0]
    assert marked_pids(marker) == []


def test_startup_timeout(tmp_path: Path, marker: str) -> None:
    a, b = free_ports(2)
    t = topo(
        tmp_path,
        marker,
        [
            {"role": "colocated", "port": a, "devices": "cpu"},
            {"role": "colocated", "port": b, "devices": "cpu", "startup_timeout": 0.5,
             "env": {"FAKE_READY_DELAY": "100"}},
        ],
    )  # fmt: skip
    la = launcher(t)
    with pytest.raises(LaunchError) as e:
        la.start()
    msg = str(e.value)
    assert (
        "colocated-1" in msg and "within 0.5s (startup_timeout)" in msg and "fake serve on" in msg
    )
    assert marked_pids(marker) == []


def test_stop_requested_during_startup(tmp_path: Path, marker: str) -> None:
    (a,) = free_ports(1)
    t = topo(
        tmp_path,
        marker,
        [{"role": "colocated", "port": a, "devices": "cpu", "env": {"FAKE_READY_DELAY": "100"}}],
    )
    la = launcher(t)
    threading.Timer(0.5, la.request_stop).start()
    with pytest.raises(LaunchAborted):
        la.start()
    assert marked_pids(marker) == []


def test_launcher_crash_takes_its_children_down(tmp_path: Path, marker: str) -> None:
    """PR_SET_PDEATHSIG: a SIGKILLed launcher leaves nothing running."""
    a, b = free_ports(2)
    t = {
        "model": "fake-model",
        "env": {"FAKE_RECORD_DIR": str(tmp_path / "rec"), MARKER_VAR: marker},
        "log_dir": str(tmp_path / "logs"),
        "instances": [{"role": "colocated", "port": p, "devices": "cpu"} for p in (a, b)],
    }
    (tmp_path / "rec").mkdir()
    driver = textwrap.dedent(
        f"""
        from pdserve.serving.launch.launcher import Launcher
        from pdserve.serving.launch.topology import Topology
        la = Launcher(Topology.from_dict({t!r}), serve_cmd={SERVE!r})
        la.start()
        la.wait()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.DEVNULL)
    try:
        state = tmp_path / "logs" / "launch.json"
        wait_until(state.exists, 30, "launch.json")
        pids = [p["pid"] for p in json.loads(state.read_text())["processes"]]
        assert pids_alive(pids) == pids
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not pids_alive(pids), 10, "the children to die with the launcher")
        assert all("term" in events(tmp_path, "serve", p) for p in (a, b))
        assert marked_pids(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path: Path, marker: str) -> None:
    a, b = free_ports(2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", b))
        busy.listen()
        t = topo(
            tmp_path,
            marker,
            [{"role": "colocated", "port": p, "devices": "cpu"} for p in (a, b)],
        )
        la = launcher(t)
        with pytest.raises(LaunchError, match=f"colocated-1: cannot use 127.0.0.1:{b} "):
            la.start()
    assert la.children == []


def test_health_probe_of_a_port_that_answers_non_http() -> None:
    """Another program on the port (it answers, but not HTTP): not healthy, no traceback."""
    import socket
    import threading

    from pdserve.serving.launch.children import healthy

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]

    def answer() -> None:
        for _ in range(2):
            conn, _ = srv.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        assert healthy(f"http://127.0.0.1:{port}") is False
        assert healthy(f"http://127.0.0.1:{port}") is False
    finally:
        t.join(timeout=10)
        srv.close()
