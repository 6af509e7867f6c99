"""benchmarks/spec_bench.py --device cpu: every section (curve, pd, decode) runs its code
path on the tiny GLM-5 preset, so a renamed key or signature fails here, not on the GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _scripts import load_script


def test_spec_bench_cpu_smoke(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.engine.engine_core import EngineCore
    from pdserve.spec_decode.draft_policy import DraftPolicy

    def policy(self: EngineCore) -> DraftPolicy | None:  # the CPU has no graphs to time
        r = self.runner
        if not r.adaptive_drafts:
            return None
        p = DraftPolicy(r.num_spec)
        p.set_costs({(s, j, 1 << 20): 1e-3 * (1 + j) for s in (1, 2, 4) for j in range(4)})
        return p

    monkeypatch.setattr(EngineCore, "_draft_policy", policy)
    bench = load_script("spec_bench")
    out = tmp_path / "spec.json"
    bench.main(["--device", "cpu", "--sections", "curve,pd,decode", "--out", str(out),
                "--workdir", str(tmp_path), "--profile-streams", "3"])  # fmt: skip
    res = json.loads(out.read_text())
    assert {(r["k"], r["policy"], r["rate"]) for r in res["decode"]["runs"]} == {
        (0, None, None),
        *((k, p, r) for k, p in ((1, "fixed"), (3, "fixed"), (3, "adaptive"))
          for r in (0.5, 0.7, 0.9)),
    }  # fmt: skip
    for r in res["decode"]["runs"] + res["curve"]["runs"]:
        assert r["tpot_ms"] > 0 and r["decode_steps"] > 0 and r["prefix_hit_tokens"] > 0
    for r in res["decode"]["runs"]:
        assert r["step_bytes"] > 0 and r["tpot_vs_none"] > 0 and r["bound_vs_none"] > 0
        if r["k"] == 0:
            assert r["bound_vs_none"] == pytest.approx(1.0)
        j = r["main_num_drafts"]
        assert j == r["k"] or r["policy"] == "adaptive"
        assert r["expected_tokens_per_step"] == sum((r["rate"] or 0) ** i for i in range(j + 1))
        if r["k"]:
            assert r["mean_accept_len"] is not None
        profiled = r["rate"] in (None, 0.7) or (r["policy"] == "adaptive" and r["rate"] == 0.5)
        if r["batch"] == 3 and profiled:  # --profile-streams 3
            assert r["profile"]["kernels"] > 0 and r["profile"]["categories"]
        else:
            assert r["profile"] is None
        assert r["steady_tpot_ms"] is None or r["steady_tpot_ms"] > 0
        assert r["kernel_compiles"] == {}  # nothing compiles on the CPU
        assert r["roofline_mixed_step_ms"] >= r["roofline_step_ms"] * (1 - 1e-9) > 0
        assert r["step_tflop"] > 0
        if r["policy"] == "adaptive":  # the costs it weighed: graph timings, then used
            pc = r["policy_costs"] if r["batch"] <= 4 else None
            assert pc is None or (len(pc["graph"]) == len(pc["used"]) == 4 == r["k"] + 1)
            assert r["batch"] > 4 or pc["graph"] == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert [r["pad"] for r in res["pd"]] == [True, False]
    assert res["pd"][0]["padded_first_steps"] > 0 == res["pd"][1]["padded_first_steps"]
    printed = capsys.readouterr().out
    assert "decode at a 40-token context" in printed and "profile k=0" in printed
    assert "ms: 1.0>" in printed
