"""tools/sm90_report.py compiles the engine's launch shapes for Hopper on the CPU (Triton's
own ptxas, no GPU): the shapes that decide GLM-5 prefill and verify speed must fit a
Hopper multiprocessor, use warpgroup MMAs, pipeline their tile loads as cp.async and
not spill. A config change or a kernel edit that breaks one of these fails here, before
any device time is spent on it. The tool runs in a process of its own: the CPU kernel
tests set TRITON_INTERPRET=1, under which the kernels cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "sm90_report.py"
sys.path.insert(0, str(TOOL.parent))

import sm90_report  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip


def test_engine_launch_shapes_compile_well_for_hopper(tmp_path: Path) -> None:
    out = tmp_path / "sm90.json"
    done = _run("--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {v.name for v in sm90_report.variants()}
    wide = rows["mla_wide"]
    assert wide["constexprs"]["BLOCK_HH"] == 64  # every head of a GLM-5 token
    assert wide["wgmma"] and wide["cp_async"] and wide["registers"] <= sm90_report.MAX_REGS
    for r in rows.values():
        assert r["shared_bytes"] <= sm90_report.MAX_SHARED and not r["problems"]


def test_an_unaligned_launch_is_reported(tmp_path: Path) -> None:
    """Without the 16-byte alignment a real launch proves, the wide MLA's latent gathers
    stay synchronous register loads: the report says so (and exits non-zero)."""
    out = tmp_path / "sm90.json"
    done = _run("--only", "mla_wide", "--drop-alignment", "--json", str(out))
    assert done.returncode == 1, done.stdout + done.stderr
    (row,) = json.loads(out.read_text())
    assert any("cp.async" in p or "spills" in p for p in row["problems"])


def test_it_refuses_to_run_interpreted() -> None:
    env_run = subprocess.run(
        [sys.executable, str(TOOL)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert env_run.returncode == 2 and "TRITON_INTERPRET" in env_run.stderr
