"""``python -m pdserve.serving.launch`` on real ``pdserve serve`` instances (tiny CPU model).

Only ``colocated`` instances: ``pdserve serve`` refuses ``--kv-transfer-config`` until
P/D lands (the P/D command lines are covered by the dry-run and supervision tests).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from .conftest import MARKER_VAR, free_ports, marked_pids, pids_alive, wait_until


def write_topology(
    tmp_path: Path, marker: str, instances: list[dict[str, Any]], model: Path
) -> Path:
    t = {
        "model": str(model),
        "served_model_name": "tiny",
        "log_dir": str(tmp_path / "logs"),
        "env": {MARKER_VAR: marker},
        "common_args": ["--dtype", "float32", "--max-model-len", "256"],
        "startup_timeout": 60,
        "grace_period": 10,
        "instances": instances,
    }
    p = tmp_path / "topology.yaml"
    p.write_text(yaml.safe_dump(t))
    return p


def launch(topology: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.serving.launch", str(topology)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def health(url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{url}/health", timeout=5) as r:
        return int(r.status)


def wait_state(tmp_path: Path, proc: subprocess.Popen[str]) -> dict[str, Any]:
    state = tmp_path / "logs" / "launch.json"

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early: {proc.communicate()}")
        return state.exists()

    wait_until(ready, 80, "the topology to be ready")
    return json.loads(state.read_text())  # type: ignore[no-any-return]


def test_two_colocated_instances_start_and_stop_on_sigterm(
    tmp_path: Path, launcher_ckpt: Path, marker: str
) -> None:
    a, b = free_ports(2)
    inst = [{"role": "colocated", "port": p, "devices": "cpu"} for p in (a, b)]
    proc = launch(write_topology(tmp_path, marker, inst, launcher_ckpt))
    try:
        state = wait_state(tmp_path, proc)
        urls = [p["url"] for p in state["processes"]]
        assert urls == [f"http://127.0.0.1:{a}", f"http://127.0.0.1:{b}"]
        assert [health(u) for u in urls] == [200, 200]
        pids = [p["pid"] for p in state["processes"]]
        everything = marked_pids(marker)  # API servers + engine cores (+ helpers)
        assert set(pids) < set(everything), (pids, everything)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "colocated-1" in out and "no proxy: call instances directly" in out
    assert "stopping the topology" in err
    assert pids_alive(everything) == []
    assert marked_pids(marker) == []
    log = (tmp_path / "logs" / "colocated-0.log").read_text()
    assert f"serving {launcher_ckpt} on http://127.0.0.1:{a}" in log


def test_a_child_crashing_at_startup_fails_the_launch(
    tmp_path: Path, launcher_ckpt: Path, marker: str
) -> None:
    a, b = free_ports(2)
    inst = [
        {"role": "colocated", "port": a, "devices": "cpu"},
        {
            "role": "colocated",
            "port": b,
            "devices": "cpu",
            "model": str(tmp_path / "no-such-model"),
        },
    ]
    proc = launch(write_topology(tmp_path, marker, inst, launcher_ckpt))
    try:
        out, err = proc.communicate(timeout=80)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (out, err)
    assert "pdserve launch: error: start-up failed: colocated-1 (pid" in err
    assert "exited with code" in err and "colocated-1.log" in err
    assert "no-such-model" in err.split("colocated-1.log", 1)[1]  # the child's own last lines
    assert not (tmp_path / "logs" / "launch.json").exists()
    assert marked_pids(marker) == []


def test_sigkilled_launcher_leaves_no_engine_behind(
    tmp_path: Path, launcher_ckpt: Path, marker: str
) -> None:
    (a,) = free_ports(1)
    inst = [{"role": "colocated", "port": a, "devices": "cpu"}]
    proc = launch(write_topology(tmp_path, marker, inst, launcher_ckpt))
    try:
        wait_state(tmp_path, proc)
        everything = marked_pids(marker)
        assert len(everything) >= 2  # the API server and its engine core
        proc.kill()
        proc.communicate(timeout=10)
        wait_until(lambda: marked_pids(marker) == [], 40, "the instance to stop itself")
    finally:
        if proc.poll() is None:
            proc.kill()
