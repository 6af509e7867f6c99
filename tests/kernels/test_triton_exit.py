"""Releasing pdserve's Triton kernels at exit (pdserve.layers.fused.release_triton), and
the smoke run of benchmarks/triton_exit_check.py (its GPU report) on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_exit_check.py"


def test_release_clears_the_kernel_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    triton = pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from pdserve.layers.fused import release_triton

    def kernel(x):  # type: ignore[no-untyped-def]
        pass

    fn = JITFunction(kernel)
    fn.device_caches["cuda:0"] = ("a compiled kernel",)  # as a launch leaves it
    wrapped = types.SimpleNamespace(fn=JITFunction(kernel))  # an autotuner's shape
    wrapped.fn.device_caches["cuda:0"] = ("another",)
    mod = types.ModuleType("pdserve.kernels._exit_probe")
    mod.kernel, mod.tuned = fn, wrapped  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    assert release_triton() >= 2
    assert not fn.device_caches and not wrapped.fn.device_caches
    assert triton is not None


def test_exit_check_smoke(tmp_path: Path) -> None:
    out = tmp_path / "exit.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "w"),
            "--modes",
            "released",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["mode"] == "released" and run["returncode"] == 0 and not run["leak_report"]
    assert "leak report" in done.stdout  # the table
