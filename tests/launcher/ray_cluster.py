"""A two-node Ray cluster on this machine for the Ray launch test: ``ray start --head``
and ``ray start --address`` (each ``--block``, in its own session, so SIGTERM to that one
process stops its node), on loopback addresses of their own (127.0.0.3 for the head,
127.0.0.2 for the second node: Ray resolves 127.0.0.1 to the machine's routable IP, any
other loopback address it keeps), every port picked free, one CPU and one custom
resource (``node_a`` / ``node_b``) each so a placement can pin an instance to a node, a
100 MB object store, no dashboard, no usage stats.

``stop()`` SIGTERMs the second node, then the head, waits for each, SIGKILLs a group that
does not go, and checks that no process still names the cluster's temp dir (every Ray
process of this cluster does, on its command line).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .conftest import free_ports

HEAD_IP = "127.0.0.3"
NODE_IP = "127.0.0.2"
_READY = "block forever"  # what `ray start --block` prints once its node is up
_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 30.0


@dataclass
class RayCluster:
    temp_dir: Path
    address: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def _start(self, name: str, args: list[str]) -> Path:
        ray_bin = Path(sys.executable).with_name("ray")
        agent, metrics, runtime_env = free_ports(3)
        log = self.temp_dir.with_name(self.temp_dir.name + f"-{name}.log")
        cmd = [
            str(ray_bin),
            "start",
            "--block",
            *args,
            "--num-cpus=1",
            "--object-store-memory=100000000",
            "--min-worker-port=0",
            "--max-worker-port=0",
            f"--dashboard-agent-listen-port={agent}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={runtime_env}",
            "--include-log-monitor=false",
            "--disable-usage-stats",
        ]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.procs.append(proc)
        self.logs.append(log)
        return log

    def _wait(self, until: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not until():
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = [
                    (p, "\n".join(p.read_text(errors="replace").splitlines()[-30:]))
                    for p in self.logs
                ]
                raise RuntimeError(f"{what} failed:\n" + "\n".join(f"{p}:\n{t}" for p, t in logs))
            time.sleep(0.2)

    def start(self) -> RayCluster:
        (gcs,) = free_ports(1)
        head = self._start(
            "head",
            [
                "--head",
                f"--node-ip-address={HEAD_IP}",
                f"--port={gcs}",
                f"--temp-dir={self.temp_dir}",
                "--include-dashboard=false",
                "--resources=" + json.dumps({"node_a": 1}),
            ],
        )
        self.address = f"{HEAD_IP}:{gcs}"
        # the second node can join as soon as the head's GCS answers (well before the
        # head's own start-up is over): start them overlapping
        self._wait(lambda: _listening(HEAD_IP, gcs), "the head's GCS")
        node = self._start(
            "node",
            [
                f"--address={self.address}",
                f"--node-ip-address={NODE_IP}",
                "--resources=" + json.dumps({"node_b": 1}),
            ],
        )
        for log in (head, node):
            self._wait(lambda log=log: _READY in log.read_text(errors="replace"), str(log))
        return self

    def leftovers(self) -> list[int]:
        """Live processes whose command line names this cluster's temp dir."""
        needle = str(self.temp_dir).encode()
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if needle in cmdline and stat[stat.rfind(")") + 2] != "Z":
                out.append(int(entry.name))
        return out

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the second node first, then the head
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = self.leftovers()
        for pid in left:  # started by this cluster's own nodes (their command lines say so)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        for log in self.logs:
            log.unlink(missing_ok=True)
        assert not left, f"Ray processes left after stopping the cluster: {left}"


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def start_cluster() -> RayCluster:
    # short: Ray's unix socket paths live under it (108 bytes at most)
    cluster = RayCluster(Path(tempfile.mkdtemp(prefix="pdray-", dir="/tmp")))
    try:
        return cluster.start()
    except BaseException:
        cluster.stop()
        raise
