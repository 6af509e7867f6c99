"""benchmarks/prefill_sweep.py: its CPU smoke mode runs every section's code path (tiny
shapes under the interpreter), so a renamed key or signature fails here, not on the GPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from _scripts import load_script


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    return load_script("prefill_sweep")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the sweep is a benchmark run")
def test_sweep_smoke_runs_every_section(
    sweep: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep.json"
    assert sweep.main(["--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for name, kinds in (("mla", {"prefill", "verify"}), ("moe", None)):
        rows = res[name]
        assert rows and not [r for r in rows if "error" in r or "skipped" in r]
        assert sum(r["default"] for r in rows) == len({r["case"] for r in rows})
        assert all(r["max_abs_diff"] < 1e-4 and r["ms"] > 0 and r["tflops"] > 0 for r in rows)
        assert len({tuple(r["config"]) for r in rows}) >= 2  # the default and another
        if kinds:
            assert {r["kind"] for r in rows} == kinds
        assert [b["case"] for b in res[f"{name}_best"]] == list(dict.fromkeys(r["case"] for r in rows))
    assert "share of the bf16 matmul rate" in capsys.readouterr().out
