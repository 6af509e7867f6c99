"""benchmarks/fp8_gemm_sweep.py: its smoke mode runs the sweep's whole code path (on the
CPU a tiny shape under the interpreter; on a GPU one shape and M of the quick grid), and
the full GPU plan stays pruned enough for its time budget."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_gemm_sweep.py"


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fp8_gemm_sweep", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fp8_gemm_sweep"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_sweep_smoke_runs_every_variant(
    sweep: ModuleType, device: torch.device, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep.json"
    args = ["--device", device.type, "--out", str(out), "--jobs", "0"]
    if device.type == "cuda":
        args += ["--quick", "--shapes", "qkv", "--tokens", "16", "--top", "1"]
    assert sweep.main(args) == 0
    res = json.loads(out.read_text())
    points = res["points"]
    assert {p["phase"] for p in points} == {"default", "tile", "refine"}
    timed = [p for p in points if p["ms"] is not None]
    assert not any(p["skipped"] for p in points) and len(timed) == len(points)
    variants = {(p["resolved"]["weight_only"], p["resolved"]["atomic_splits"]) for p in timed}
    assert variants == {(False, False), (True, False), (False, True), (True, True)}
    assert all(p["ok"] and p["rel_err"] < sweep.TOL for p in timed)  # each vs its reference
    groups = {(p["shape"], p["m"]) for p in points}
    assert len(res["summary"]) == len(res["references"]) == len(groups)
    for row in res["summary"]:
        assert row["default_ms"] > 0 and row["best_ms"] <= row["default_ms"]
        assert row["bf16_ms"] > 0 and row["roofline_ms"] > 0
    assert res["meta"]["limits"]["copy_bandwidth_Bps"] > 0
    assert "bf16/best" in capsys.readouterr().out


def test_full_gpu_plan_is_pruned(sweep: ModuleType) -> None:
    """The H200 plan (132 SMs): today's default for every shape and M, no split from
    M=1024 on, and few enough points and kernels (each compile ~0.5 s, in parallel)."""
    points = sweep.plan_tiles(sweep.SHAPES, sweep.TOKENS, False, False, 132)
    assert len({(p.shape, p.m) for p in points if p.phase == "default"}) == 15
    assert all(p.resolved.num_splits == 1 for p in points if p.m >= sweep.LARGE_M)
    kernels = {sweep.compile_key(p.resolved) for p in points}
    assert len(points) < 520 and len(kernels) < 200
    rng = random.Random(0)
    for p in points:
        p.ms = rng.random()
    refine = sweep.plan_refinements(points, False, 132, sweep.TOP)
    assert len(refine) < 320
    assert len({sweep.compile_key(p.resolved) for p in refine} - kernels) < 120
    assert {p.resolved.weight_only for p in refine if p.m <= sweep.SMALL_M} == {False, True}
