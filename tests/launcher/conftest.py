"""Fixtures for the launcher tests: a tiny checkpoint, free loopback ports, process probes.

Every process the tests start carries a unique marker in its environment (the topology's
``env``), so "no leftovers" is checked by scanning ``/proc/*/environ`` for it: that
finds the engine-core processes too, which inherit the environment.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from _ports import free_ports  # noqa: F401  (the launcher tests import it from here)

FAKE_SERVER = Path(__file__).with_name("fake_server.py")
MARKER_VAR = "PDSERVE_LAUNCH_TEST"

if not sys.platform.startswith("linux"):
    pytest.skip("the launcher tests read /proc", allow_module_level=True)


@pytest.fixture(scope="session")
def launcher_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdserve.testing.checkpoint import make_checkpoint

    d = tmp_path_factory.mktemp("launcher-tiny-llama")
    make_checkpoint("LlamaForCausalLM", "tiny", d, dtype="float32")
    return d


@pytest.fixture
def marker() -> str:
    return uuid.uuid4().hex


def _live(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def pids_alive(pids: list[int]) -> list[int]:
    return [p for p in pids if _live(p)]


def marked_pids(marker: str) -> list[int]:
    """Live (non-zombie) processes whose environment holds ``MARKER_VAR=marker``."""
    needle = f"{MARKER_VAR}={marker}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and _live(int(entry.name)):
            out.append(int(entry.name))
    return out


def wait_until(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
