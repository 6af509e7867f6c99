"""benchmarks/glm5_kernels_bench.py's indexer_prefill / indexer_verify / indexer_fp8 sections: their
whole code path (sweep, checks, selects, backend, JSON, tables) at toy shapes under the
interpreter on the CPU (``--cpu-smoke``), or ``--quick`` on a GPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "glm5_kernels_bench", BENCH / "glm5_kernels_bench.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["glm5_kernels_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_indexer_sections_smoke(
    bench: ModuleType, device: torch.device, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "idx.json"
    mode = "--quick" if device.type == "cuda" else "--cpu-smoke"
    bench.main(["--out", str(out), "--sections", "indexer_prefill,indexer_verify", mode])
    res = json.loads(out.read_text())
    for section, kinds in (("indexer_prefill", "prefill"), ("indexer_verify", "verify")):
        rows = res[section]
        cases = {r["case"] for r in rows}
        assert cases and all(c.startswith(kinds) for c in cases)
        for case in cases:
            mine = {r["kernel"]: r for r in rows if r["case"] == case}
            assert mine["old per-token"]["ms"] > 0
            tiled = [r for k, r in mine.items() if k.startswith("tiled ")]
            assert tiled and all(r["error"] is None and r["ms"] > 0 for r in tiled)
            assert all(r["max_abs_diff"] < 2e-2 and r["TFLOP/s"] > 0 for r in tiled)
            assert mine["best"]["ms"] == min(r["ms"] for r in tiled)
            selects = [r for k, r in mine.items() if k.startswith("select ")]
            assert {"select radix", "select torch.topk"} <= {r["kernel"] for r in selects}
            assert all(r["max_abs_diff"] < 2e-2 for r in selects)
            assert sum(r["used"] for r in selects) == 1
            if section == "indexer_prefill":
                assert mine["backend"]["ms"] > 0
            else:
                assert all(r["GB/s"] > 0 for r in tiled)
    for v in ("rows_bits", "rows_hist"):  # both register selects ran
        assert [r for r in res["indexer_prefill"] if r["kernel"] == f"select {v}"]
    printed = capsys.readouterr().out
    assert "== indexer_prefill" in printed and "== indexer_verify" in printed


def test_indexer_fp8_section_smoke(
    bench: ModuleType, device: torch.device, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bf16 beside fp8 keys for decode, prefill and verify: both score kernels and both
    backends timed; fp8 moves fewer bytes, its scores within fp8's error of the bf16
    ones (random keys: a few percent of the largest score) and most of its top-k the same."""
    out = tmp_path / "fp8.json"
    mode = "--quick" if device.type == "cuda" else "--cpu-smoke"
    bench.main(["--out", str(out), "--sections", "indexer_fp8", mode])
    rows = json.loads(out.read_text())["indexer_fp8"]
    cases = {r["case"] for r in rows}
    assert {c.split()[0] for c in cases} == {"decode", "prefill", "verify"}
    for case in cases:
        mine = {r["kernel"]: r for r in rows if r["case"] == case}
        assert set(mine) == {"score bf16", "score fp8", "score fp8 k+q", "backend bf16",
                             "backend fp8"}  # fmt: skip
        assert all(r["ms"] > 0 for r in mine.values())
        bf16, fp8, fp8q = mine["score bf16"], mine["score fp8"], mine["score fp8 k+q"]
        assert fp8q["bytes"] < fp8["bytes"] < bf16["bytes"]
        for r in (fp8, fp8q):
            assert r["GB/s"] > 0 and r["TFLOP/s"] > 0 and r["speedup"] > 0
            assert 0 < r["max_rel_diff"] < 0.1
        assert mine["backend fp8"]["select_overlap"] > 0.5
    assert "== indexer_fp8" in capsys.readouterr().out


def test_cpu_smoke_refuses_other_sections(bench: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--cpu-smoke runs only"):
        bench.main(["--out", str(tmp_path / "x.json"), "--sections", "mla", "--cpu-smoke"])
