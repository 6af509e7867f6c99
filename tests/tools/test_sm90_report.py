"""tools/sm90_report.py compiles the engine's launch shapes for Hopper on the CPU (Triton's
own ptxas, no GPU): the shapes that decide GLM-5 prefill and verify speed must fit a
Hopper multiprocessor, use warpgroup MMAs, pipeline their tile loads as cp.async and
not spill; the decode path's small fused kernels must stay small. A config change or a kernel edit that breaks one of these fails here, before
any device time is spent on it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import sm90_report  # noqa: E402


def test_engine_launch_shapes_compile_well_for_hopper(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sm90.json"
    assert sm90_report.main(["--json", str(out)]) == 0, capsys.readouterr().out
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {v.name for v in sm90_report.variants()}
    wide = rows["mla_wide"]
    assert wide["constexprs"]["BLOCK_HH"] == 64  # every head of a GLM-5 token
    assert wide["wgmma"] and wide["cp_async"] and wide["registers"] <= sm90_report.MAX_REGS
    for r in rows.values():
        assert r["shared_bytes"] <= sm90_report.MAX_SHARED and not r["problems"]
    for v in sm90_report.decode_prep_variants():  # the decode path's small fused kernels
        assert rows[v.name]["registers"] <= 128, rows[v.name]


def test_an_unaligned_launch_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    """Without the 16-byte alignment a real launch proves, the wide MLA's latent gathers
    stay synchronous register loads: the report says so (and exits non-zero)."""
    v = next(v for v in sm90_report.variants() if v.name == "mla_wide")
    unaligned = sm90_report.Variant(**{**v.__dict__, "name": "mla_wide_unaligned",
                                       "aligned_ints": frozenset()})  # fmt: skip
    r = sm90_report.report(unaligned)
    assert any("cp.async" in p or "spills" in p for p in r["problems"])
