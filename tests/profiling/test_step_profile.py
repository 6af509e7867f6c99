"""Step profiles (pdserve.profiling.step_profile): the category rules, the table's arithmetic,
the replay's categories from the eager run, and ``benchmarks/glm5_bench.py --device cpu
--profile`` end to end on the tiny GLM-5 (a smoke run of the GPU profile's code path)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from _stand_in_graphs import stand_in_graphs
from pdserve.profiling.step_profile import (
    CATEGORIES,
    GAP,
    Span,
    StepProfile,
    align_categories,
    categorize,
    clip_waits,
    format_tables,
    profile_step,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "scope", "want"),
    [
        ("_select_kernel", "indexer_score", "topk_select"),  # the indexer's select
        ("void at::native::sbtopk::gatherTopK<float>", "indexer_score", "topk_select"),
        ("_logits_kernel", "indexer_score", "indexer_score"),
        ("_indexer_prep_kernel", "indexer_score", "norm_rope"),  # RoPE, norm, cache write
        ("_mla_prep_kernel", None, "norm_rope"),
        ("_align_kernel", "moe_experts", "moe_experts"),
        ("DeviceRadixSortOnesweepKernel", "moe_experts", "moe_experts"),  # expert alignment
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "router", "router"),  # the router's GEMM
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", None, "dense_gemm"),
        ("aten::bmm", "mla_attention", "dense_gemm"),  # absorbed W_UK / W_UV
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "mla_attention", "dense_gemm"),
        ("_rope_kernel", "indexer_score", "norm_rope"),
        ("_rmsnorm_kernel", None, "norm_rope"),
        ("_mla_kernel", None, "mla_attention"),
        ("_prefill_kernel", None, "mla_attention"),  # the sparse MLA prefill kernels
        ("_gluon_prefill_kernel", None, "mla_attention"),
        ("_gluon_ws_kernel", None, "mla_attention"),
        ("_fp8_gemm_ws_kernel", None, "dense_gemm"),  # run 130: was "mla_attention"
        ("_rows_kernel", "mla_attention", "mla_attention"),  # their candidate rows
        ("_gate_up_kernel", None, "moe_experts"),
        ("_gate_up_fp8_kernel", None, "moe_experts"),  # the FP8 MoE (run 98: was "other")
        ("_down_fp8_kernel", None, "moe_experts"),
        ("Memcpy HtoD (Pinned -> Device)", None, "other"),
        ("void at::native::vectorized_elementwise_kernel<4>", "dense_gemm", "dense_gemm"),
        # a range left open does not take the kernels only one category launches
        ("_mla_kernel", "indexer_score", "mla_attention"),
        ("_gate_up_kernel", "indexer_score", "moe_experts"),
        ("_logits_kernel", "moe_experts", "indexer_score"),
        ("_reg_select_kernel", "moe_experts", "topk_select"),
        ("_rmsnorm_kernel", "moe_experts", "norm_rope"),
        ("_mla_prep_kernel", "router", "norm_rope"),
        ("_router_logits_kernel", None, "router"),  # not the indexer's _logits_kernel
        ("_router_logits_kernel", "indexer_score", "router"),
        # a projection's GEMM in a range left open (run 140's 64K prefill); the CPU
        # reference's own score products (aten operators) stay the indexer's
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "indexer_score", "dense_gemm"),
        ("aten::matmul", "indexer_score", "indexer_score"),
    ],
)
def test_categorize(name: str, scope: str | None, want: str) -> None:
    assert categorize(name, scope) == want


def test_table_shares_and_idle_gap() -> None:
    """Kernels 0-10 us, 12-20 us and 15-18 us (overlapping): span 20 us, busy 18 us."""
    p = StepProfile(
        [Span("g", 0, 10, "dense_gemm"), Span("e", 12, 20, "moe_experts"),
         Span("e2", 15, 18, "moe_experts")],
        wall_ms=0.05,
        device="cuda",
    )  # fmt: skip
    t = p.table()
    assert t["span_ms"] == pytest.approx(0.020)
    assert t[GAP]["ms"] == pytest.approx(0.002)
    assert t[GAP]["share"] == pytest.approx(0.1)
    assert t["categories"]["moe_experts"]["ms"] == pytest.approx(0.011)
    assert t["categories"]["moe_experts"]["count"] == 2
    assert t["categories"]["dense_gemm"]["share"] == pytest.approx(0.5)
    assert t["top"][0]["name"] == "g"
    text = format_tables({"graph replay": t})
    assert "idle_gap" in text and "moe_experts" in text
    assert f"| {t['kernels']:22d}" in text.splitlines()[-2]  # kernels per step


def test_a_kernel_launched_early_counts_from_its_predecessors_end() -> None:
    """Stream 7: a GEMM 0-10 us, a norm launched early at 2 us that ends at 12 (it waited
    8 us for the GEMM), then a copy 12-13; stream 9 runs beside it and keeps its span."""
    spans = clip_waits(
        [Span("gemm", 0, 10, "dense_gemm", stream=7), Span("norm", 2, 12, "norm_rope", stream=7),
         Span("copy", 12, 13, "other", stream=7), Span("side", 1, 11, "other", stream=9),
         Span("cpu_op", 0, 5, "other")]
    )  # fmt: skip
    assert [s.busy_us for s in spans] == [10, 2, 1, 10, 5]
    t = StepProfile(spans[:4], wall_ms=0.02, device="cuda").table()
    assert t["categories"]["norm_rope"]["ms"] == pytest.approx(0.002)
    assert t[GAP]["ms"] == pytest.approx(0.0)  # the union of spans is unchanged


def test_replay_kernels_take_the_eager_runs_categories() -> None:
    eager = StepProfile(
        [Span("copy", 0, 1, "other"), Span("k", 1, 2, "indexer_score"),
         Span("sort", 2, 3, "moe_experts"), Span("k", 3, 4, "mla_attention")],
        1.0, "cuda",
    )  # fmt: skip
    graph = StepProfile(
        [Span("k", 0, 1, "other"), Span("sort", 1, 2, "other"), Span("k", 2, 3, "other"),
         Span("x_gemm", 3, 4, "other"), Span("sort", 4, 5, "other")],
        1.0, "cuda",
    )  # fmt: skip
    assert align_categories(graph, eager) == 3
    cats = [s.category for s in graph.spans]
    # in order; then the eager run's category of the name; then the name rules
    assert cats == ["indexer_score", "moe_experts", "mla_attention", "dense_gemm", "moe_experts"]
    assert "3 of 5" in graph.notes[0]


def test_cpu_profile_names_module_ranges() -> None:
    from pdserve.layers.linear import Linear
    from pdserve.layers.norm import RMSNorm

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(32, 1e-5, torch.float32)
            self.proj = Linear(32, 32, dtype=torch.float32)
            torch.nn.init.normal_(self.proj.weight)
            torch.nn.init.ones_(self.norm.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(self.norm(x)).relu()

    m = Tiny()
    x = torch.randn(4, 32)
    p = profile_step(lambda: m(x), m, "cpu")
    cats = {s.category for s in p.spans}
    assert {"dense_gemm", "norm_rope"} <= cats
    assert all(s.category in CATEGORIES for s in p.spans)
    relu = [s for s in p.spans if s.name in ("aten::relu", "aten::clamp_min")]
    assert relu and all(s.category == "other" for s in relu)  # outside every module range


def _load_bench() -> object:
    spec = importlib.util.spec_from_file_location("glm5_bench", ROOT / "benchmarks/glm5_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["glm5_bench"] = bench
    spec.loader.exec_module(bench)
    return bench


def test_glm5_bench_cpu_profile_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The --profile path on the CPU: a 4 x 48 batch whose prompts prefill over several
    64-token steps, every request decoding in every timed step (graph path, stood in),
    then one profiled step of each kind; the replay's operators take the categories of
    the eager run of the same forward."""
    bench = _load_bench()
    engine = bench._engine  # type: ignore[attr-defined]

    def with_graphs(*args: object) -> object:
        llm, dummy, startup = engine(*args)
        stand_in_graphs(llm)
        return llm, dummy, startup

    monkeypatch.setattr(bench, "_engine", with_graphs)
    threads = torch.get_num_threads()
    out = tmp_path / "p.json"
    argv = ["--device", "cpu", "--profile", "4x48", "--out", str(out), "--workdir", str(tmp_path)]
    bench.main(argv)  # type: ignore[attr-defined]
    assert torch.get_num_threads() == threads  # the smoke run's one thread is given back
    res = json.loads(out.read_text())
    (pr,) = res["profile"]
    (p,) = pr["points"]
    assert (p["batch"], p["ctx"]) == (4, 48)
    assert p["live_min"] == p["live_max"] == 4 and p["preemptions"] == 0
    assert p["graph_steps"] == 4  # every timed step took the graph path
    assert len(p["active_experts"]) == 3 and all(2 <= a <= 8 for a in p["active_experts"])
    assert p["mean_seq_len"] > 48 and p["bytes"]["index_keys"] > 0  # past index_topk 16
    steps = p["steps"]
    assert set(steps) == {"graph replay", "eager, graph shape", "eager"}
    for name, t in steps.items():
        for cat in ("moe_experts", "router", "mla_attention", "indexer_score", "dense_gemm"):
            assert t["categories"][cat]["ms"] > 0, (name, cat)
        assert t["span_ms"] > 0 and 0 <= t[GAP]["share"] < 1
    assert "matched in order" in steps["graph replay"]["notes"][0]


def test_glm5_bench_cpu_prefill_smoke(tmp_path: Path) -> None:
    """The prefill section on the CPU: prompts within and beyond index_topk, each timed
    three times (after an untimed one) without a prefix-cache hit and profiled once; the categories carry the FLOP
    model's counts (the indexer scores only the prompt beyond top-k)."""
    bench = _load_bench()
    out = tmp_path / "p.json"
    argv = ["--device", "cpu", "--sections", "prefill", "--prefill-lens", "12,40,900",
            "--out", str(out), "--workdir", str(tmp_path)]  # fmt: skip
    bench.main(argv)  # type: ignore[attr-defined]
    (pf,) = json.loads(out.read_text())["prefill"]
    short, long_, skipped = pf["points"]
    assert "max_model_len" in skipped["skipped"]  # 900 + 1 > the CPU engine's 512
    for p in (short, long_):
        assert p["prefix_cache_hits"] == 0 and p["seconds"] > 0 and p["warmup_s"] > 0
        assert len(p["runs_s"]) == 3
        assert "no NVML for a cpu device" in p["clock"]["nvml"]  # sampled on CUDA only
        cats = p["profile"]["categories"]
        diag = p["profile"]["diagnostics"]  # every categorised module ran inside its range
        assert diag["ranges"]["mla_attention"]["count"] > 0 and diag["device_activities"] == 0
        for cat in ("mla_attention", "moe_experts", "dense_gemm"):
            assert cats[cat]["ms"] > 0 and cats[cat]["tflop"] == p["flops"][cat] / 1e12
    assert short["flops"]["indexer_score"] == 0.0 and long_["flops"]["indexer_score"] > 0
    sus = pf["sustained_matmul"]  # the rate matmuls sustain, and each category's share of it
    assert sus["flops"] > 0 and sus["samples"] > 0 and "nvml" in sus["clock"]
    mla = long_["profile"]["categories"]["mla_attention"]
    assert mla["share_of_sustained"] == pytest.approx(mla["tflops"] * 1e12 / sus["flops"])
    assert long_["profile"]["categories"]["indexer_score"]["ms"] > 0


def test_device_kernels_take_their_launching_operators_range() -> None:
    """The CUDA path of spans_from_events and scope_diagnostics on stand-in events: a
    kernel inherits the range around the operator that launched it, one whose operator
    is missing or outside every range goes by its name, and the range's device mirror
    is no kernel."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from pdserve.profiling.step_profile import scope_diagnostics, spans_from_events

    def ev(i, name, dev, start, end, link=0, parent=None):  # type: ignore[no-untyped-def]
        return SimpleNamespace(id=i, name=name, device_type=dev, linked_correlation_id=link,
                               time_range=SimpleNamespace(start=start, end=end),
                               cpu_parent=parent)  # fmt: skip

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    rng = ev(1, "pdserve:dense_gemm", cpu, 0, 100)
    op_in = ev(2, "aten::mm", cpu, 10, 20, parent=rng)
    op_out = ev(3, "aten::add", cpu, 120, 130)
    events = [
        rng, op_in, op_out,
        ev(10, "pdserve:dense_gemm", cuda, 0, 100, link=1),  # the range's device mirror
        ev(11, "some_kernel", cuda, 30, 40, link=2),
        ev(12, "elementwise_kernel", cuda, 140, 150, link=3),
        ev(13, "_rmsnorm_kernel", cuda, 160, 170, link=99),  # its operator was lost
    ]  # fmt: skip
    spans = spans_from_events(events, "cuda")
    assert [(s.name, s.category) for s in spans] == [
        ("some_kernel", "dense_gemm"),
        ("elementwise_kernel", "other"),
        ("_rmsnorm_kernel", "norm_rope"),
    ]
    diag = scope_diagnostics(events)
    assert diag["ranges"] == {"dense_gemm": {"count": 1, "ms": 0.1, "longest_ms": 0.1}}
    assert (diag["device_activities"], diag["without_operator"], diag["outside_ranges"]) == (
        3, 1, 1)
    # the kernel outside every range, with its operator's chain (no parent here), and the
    # one without an operator, with its ids and its launch call's chain (none captured)
    assert diag["outside_samples"] == [
        {"kernel": "elementwise_kernel", "operator_chain": ["aten::add [120, 130]"]},
        {"kernel": "_rmsnorm_kernel", "ids": [13, 99], "launch_chain": []},
    ]
    launch = ev(13, "cudaLaunchKernel", cpu, 15, 16, link=99, parent=op_in)
    launch.thread = 7
    diag = scope_diagnostics([*events, launch])
    assert diag["outside_samples"][1]["launch_chain"] == [
        "cudaLaunchKernel [15, 16] t7", "aten::mm [10, 20]", "pdserve:dense_gemm [0, 100]"
    ]
    assert diag["range_threads"] == ["None"]
