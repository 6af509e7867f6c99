"""The capacity planner against cases solved by hand, and on a real gpu_suite result."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from pdserve.bench import plan as P

ROOT = Path(__file__).resolve().parents[2]


def _curves(step_ms: float = 10.0, prefill_tok_s: float = 10_000.0, **extra: object) -> P.Curves:
    data = {
        "prefill": {"tokens": 1000, "tok_s": prefill_tok_s},
        "decode": [{"batch": b, "ctx": 1000, "step_ms": step_ms} for b in (1, 64)],
        **extra,
    }
    return P.Curves.from_json(data)


def test_prefill_bound_pd_capacity_is_the_mdl_solution() -> None:
    """Prefill 0.1 s per prompt, TTFT SLA 0.5 s, constant 10 ms decode steps (never the
    limit): TTFT = W + S with W = rho S / (2 (1 - rho)), so W <= 0.4 - step gives the
    largest rho per prefill GPU in closed form."""
    c = _curves()
    s = P.Shape(input_len=1000, output_len=10, ttft_s=0.5, tpot_s=0.02)
    step = 0.010
    budget = 0.5 - 0.1 - step  # wait allowed per prompt
    rho = 2 * budget / (0.1 + 2 * budget)  # rho S / (2 (1 - rho)) = budget
    preds = {p.layout: p for p in P.plan(c, s, 2)}
    one_one = preds["1P1D"]
    assert one_one.capacity_rps == pytest.approx(rho / 0.1, rel=1e-3)
    assert one_one.limited_by == "TTFT"
    assert one_one.ttft_ms == pytest.approx(500, rel=1e-3)
    assert one_one.tpot_ms == pytest.approx(10.0)


def test_decode_bound_by_kv_capacity() -> None:
    """Decode steps always within the SLA: capacity = KV slots / (TPOT x output_len)
    by Little's law (batch = rate x output_len x TPOT)."""
    c = _curves(prefill_tok_s=1e9, num_kv_blocks=10 * 1100 // 16 + 1, block_size=16)
    s = P.Shape(input_len=1000, output_len=100, ttft_s=10.0, tpot_s=0.02)
    slots = c.kv_tokens / 1100  # type: ignore[operator]
    preds = {p.layout: p for p in P.plan(c, s, 2)}
    assert preds["1P1D"].capacity_rps == pytest.approx(slots / (100 * 0.010), rel=1e-3)
    assert preds["1P1D"].limited_by.startswith("decode KV capacity")


def test_colocated_pays_for_prefill_in_tpot() -> None:
    """A colocated GPU spending a share u of its time on prefill stretches every decode
    step by 1 / (1 - u): at the TPOT limit 20 ms with 10 ms steps, u = 0.5."""
    c = _curves(step_ms=10.0, prefill_tok_s=10_000.0)
    s = P.Shape(input_len=1000, output_len=100, ttft_s=100.0, tpot_s=0.02)
    colo = next(p for p in P.plan(c, s, 1) if p.layout == "colocated x1")
    assert colo.capacity_rps == pytest.approx(0.5 / 0.1, rel=1e-3)  # u = rate x 0.1 s
    assert colo.tpot_ms == pytest.approx(20.0, rel=1e-3) and colo.limited_by == "TPOT"


def test_more_gpus_never_lower_capacity_and_best_first() -> None:
    c = _curves(step_ms=12.0, prefill_tok_s=20_000.0, num_kv_blocks=20_000)
    s = P.Shape(input_len=2000, output_len=200, ttft_s=2.5, tpot_s=0.02)
    best = [P.plan(c, s, n)[0].capacity_rps for n in (1, 2, 4, 8)]
    assert best == sorted(best) and best[0] > 0
    preds = P.plan(c, s, 8)
    caps = [p.capacity_rps for p in preds]
    assert caps == sorted(caps, reverse=True)
    assert {p.layout for p in preds} == {"colocated x8"} | {f"{x}P{8 - x}D" for x in range(1, 8)}


def test_interpolation() -> None:
    c = P.Curves.from_json(
        {
            "prefill": [{"tokens": 1000, "tok_s": 10_000}, {"tokens": 3000, "tok_s": 7_500}],
            "decode": [
                {"batch": 1, "ctx": 1000, "step_ms": 4},
                {"batch": 1, "ctx": 3000, "step_ms": 6},
                {"batch": 9, "ctx": 1000, "step_ms": 8},
                {"batch": 9, "ctx": 3000, "step_ms": 12},
            ],
        }
    )
    assert c.prefill_s(2000) == pytest.approx((0.1 + 0.4) / 2)
    assert c.step_s(5, 2000) == pytest.approx((0.005 + 0.010) / 2)
    assert c.step_s(1, 500) == pytest.approx(0.004)  # clamped in context
    assert c.step_s(17, 1000) == pytest.approx(0.012)  # extrapolated in batch


def test_prefill_curve_wins_over_the_single_prefill_point() -> None:
    """The suite's ``prefill_curve`` (prompts packed into full steps, one point per length)
    is read in place of its one-prompt ``prefill`` point; skipped lengths are left out."""
    c = P.Curves.from_json(
        {
            "prefill": {"tokens": 8192, "tok_s": 30_000},
            "prefill_curve": [
                {"tokens": 1024, "tok_s": 40_000},
                {"tokens": 8192, "tok_s": 30_000},
                {"tokens": 65536, "skipped": "max_model_len below the prompt"},
            ],
            "decode": [{"batch": 1, "ctx": 1000, "step_ms": 4}],
        }
    )
    assert c.prefill == [(1024, 1024 / 40_000), (8192, 8192 / 30_000)]
    assert c.prefill_s(1024) == pytest.approx(1024 / 40_000)


def test_cli_on_a_gpu_suite_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The gpu_suite JSON of run 29 (llama-8b-shape on the H200) is a valid curves file."""
    p = argparse.ArgumentParser()
    P.add_cli_args(p)
    out = tmp_path / "plan.json"
    curves = ROOT / "benchmarks/results/2026-12-01-run29-gpu-suite-decode.json"
    args = p.parse_args(
        ["--curves", str(curves), "--input-len", "1024", "--output-len", "128", "--num-gpus", "4"]
        + ["--json", str(out)]
    )
    assert P.main(args) == 0
    text = capsys.readouterr().out
    assert "colocated x4" in text and "3P1D" in text
    preds = json.loads(out.read_text())
    assert len(preds) == 4 and all(math.isfinite(p["capacity_rps"]) for p in preds)
    assert preds[0]["capacity_rps"] > 0
    bad = p.parse_args(
        ["--curves", str(tmp_path / "none.json"), "--input-len", "1"]
        + ["--output-len", "1", "--num-gpus", "1"]
    )
    assert P.main(bad) == 2
