"""A real ``pdserve serve`` subprocess on a tiny checkpoint, on 127.0.0.1 only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from _ports import free_port, free_ports  # noqa: F401  (tests import them from here)


def metric(url: str, name: str, missing_ok: bool = False, **labels: str) -> float:
    """Sum of the series ``name`` (with these label values) on ``url``/metrics.

    A name with no matching series raises ``KeyError`` unless ``missing_ok`` (then 0)."""
    total = 0.0
    found = False
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found and not missing_ok:
        raise KeyError(name)
    return total


@dataclass
class LiveServer:
    proc: subprocess.Popen
    url: str
    model: str
    log: Path

    def metric(self, name: str) -> float:
        return metric(self.url, name)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(10)
        return int(self.proc.returncode)


def start_server(model: Path, tmp: Path, *extra: str, timeout: float = 120) -> LiveServer:
    port = free_port()
    log = tmp / f"serve-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "serve",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        *extra,
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    srv = LiveServer(proc, f"http://127.0.0.1:{port}", "tiny", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{srv.url}/health", timeout=1).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    srv.stop()
    raise RuntimeError(f"server not ready in {timeout}s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def live_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = start_server(tiny_llama, tmp_path_factory.mktemp("live"), "--max-model-len", "1024")
    yield srv
    srv.stop()
