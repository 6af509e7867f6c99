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


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the sweep is a benchmark run")
def test_sweep_smoke_mla_variants(
    sweep: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every prefill variant beside the general kernel, on a sparse and a dense prefill
    and a verify batch: same output, timed, and the table printed; the Gluon kernel's
    variants are listed as skipped (they need Hopper)."""
    from pdserve.kernels.sparse_mla_gluon import VARIANTS as GLUON
    from pdserve.kernels.sparse_mla_prefill import VARIANTS

    out = tmp_path / "variants.json"
    assert sweep.main(["--device", "cpu", "--sections", "mla_variants", "--out", str(out)]) == 0
    every = json.loads(out.read_text())["mla_variants"]
    skipped = [r for r in every if "skipped" in r]
    # (the model-layout case times the engine's variant, gluon_ws, beside the reference)
    assert {r["config"] for r in skipped} == set(GLUON) and len(skipped) == 3 * len(GLUON) + 1
    assert all("Hopper" in r["skipped"] and r["variant"] == r["config"] for r in skipped)
    rows = [r for r in every if "skipped" not in r]
    assert not [r for r in rows if "error" in r]
    assert {r["case"] for r in rows} == {"prefill 12", "prefill 40", "verify 3x4",
                                         "prefill 40 model layout"}  # fmt: skip
    assert rows[0]["case"] == "prefill 40"  # the longest prefill first: it picks the variant
    for case in ("prefill 12", "prefill 40", "verify 3x4"):
        got = {r["config"] for r in rows if r["case"] == case}
        assert got == {f"general {list(c)}" for c in sweep.BASELINES} | set(VARIANTS)
    layout = [r for r in rows if r["case"] == "prefill 40 model layout"]
    assert [r["config"] for r in layout] == [f"general {list(sweep.BASELINES[0])}"]
    assert all(r["max_abs_diff"] < 1e-4 and r["ms"] > 0 and r["total_ms"] >= r["ms"] for r in rows)
    assert all(r["rows_ms"] > 0 for r in rows if "variant" in r)
    # the gather bound of each case (checked against its reference at these sizes)
    assert all(r["gather_ms"] > 0 and r["gather_tbps"] > 0 for r in every)
    assert all(r["share_of_gather"] > 0 and r["tbps"] > 0 for r in rows)
    assert sum(r["default"] for r in rows) == 4
    printed = capsys.readouterr().out
    assert "max abs diff vs the general" in printed and "gather only (the bound)" in printed


def test_gather_bound_sums_each_tokens_candidate_rows(device: torch.device) -> None:
    """benchmarks/_gather_bound.py, every config: each token's sum over its candidate
    rows (-1 and rows past its count read nothing; a token without rows sums to 0)."""
    gb = load_script("_gather_bound")
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(6, 4, 32 + 16, generator=g).to(device)
    rows = torch.tensor([[0, 5, -1, 9, 23, 2, 7, 1], [4, 4, 11, -1, -1, -1, -1, -1],
                         [3, 8, 12, 0, 0, 0, 0, 0]], device=device)  # fmt: skip
    ncand = torch.tensor([8, 3, 0], dtype=torch.int32, device=device)
    want = gb.gather_reference(cache, rows, ncand, 3)
    assert want[2] == 0
    for cfg in gb.CONFIGS:
        got = gb.gather_rows(cache, rows, ncand, 3, 32, 16, cfg)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the bench is a benchmark run")
def test_select_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/select_bench.py: every select variant on a chunked prompt, its selection
    the same scores as torch.topk's; the default is marked."""
    bench = load_script("select_bench")
    out = tmp_path / "select.json"
    assert bench.main(["--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["select"]
    assert {r["variant"] for r in rows} == {"rows_bits", "rows_hist", "radix", "split",
                                            "torch.topk"} | {
        f"{v}@{w}w" for v in ("rows_bits", "rows_hist") for w in (16, 32)} | {
        f"split@{x}" for x in bench.SPLIT_SHAPES_CPU} | {"rows_bits@tail4", "rows_bits@tail16"}
    assert all(r["exact"] and r["score_bytes"] > 0 for r in rows)
    cases = {r["case"] for r in rows}  # a chunked prompt; a decode row in a wider buffer
    assert cases == {"prefill 48", "decode 1 x 40, 64 graph"}
    assert all(sum(r["default"] for r in rows if r["case"] == c) == 1 for c in cases)
    assert "== select" in capsys.readouterr().out
