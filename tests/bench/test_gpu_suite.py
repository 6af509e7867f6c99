"""benchmarks/gpu_suite.py --device cpu: every section's code on the tiny Llama (a smoke
run of the H200 suite, so a renamed key or signature fails here), with CUDA graphs stood
in so the decode section takes the graph path and times a replay of the graph its last
step replayed; its JSON is a curves file `pdserve plan` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _ports import free_port
from _scripts import load_script
from _stand_in_graphs import stand_in_graphs
from pdserve.bench import plan as P


def test_every_section_runs_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    suite = load_script("gpu_suite")
    make = suite.make_engine
    replayed: list[tuple[int, int, int]] = []

    def with_graphs(*args: object) -> object:
        llm, err = make(*args)
        stand_in_graphs(llm, replayed)
        return llm, err

    monkeypatch.setattr(suite, "make_engine", with_graphs)
    threads = torch.get_num_threads()
    out = tmp_path / "suite.json"
    argv = ["--device", "cpu", "--out", str(out), "--serve-port", str(free_port())]
    assert suite.main(argv) == 0
    assert torch.get_num_threads() == threads  # the smoke run's one thread is given back
    res = json.loads(out.read_text())
    assert [k for k in res if k.endswith("_error")] == []
    sizes = suite.CPU_SIZES
    assert res["limits"]["copy_bandwidth_Bps"] > 0 and res["limits"]["bf16_matmul_flops"] > 0
    assert res["throughput"]["output_tok_s"] > 0

    decode = res["decode"]
    want = [(int(b), int(c)) for c in sizes.contexts.split(",") for b in sizes.batches.split(",")]
    assert [(r["batch"], r["ctx"]) for r in decode] == want
    for r in decode:
        assert r["running_during_timing"] == [r["batch"], r["batch"]]
        assert r["kernel_compiles"] == {}  # nothing compiles on the CPU
        assert r["step_ms"] > 0 and r["roofline_ms"] > 0 and r["async_step_ms"] > 0
        assert r["graph_replay_ms"] > 0  # the replay of the last step's graph, timed
    assert {(b, 1, sizes.max_model_len) for b in (1, 2)} <= set(replayed)
    (profiled,) = [r for r in decode if "kernels" in r]
    assert (profiled["batch"], profiled["ctx"]) == (2, 24) and profiled["kernels"]["top"]
    assert res["step_paths"]["graph"] > 0

    assert res["prefill"]["tokens"] == sizes.prefill_len and res["prefill"]["tok_s"] > 0
    curve = res["prefill_curve"]
    assert [p["tokens"] for p in curve] == [16, 64] and curve[0]["prompts_per_round"] == 4
    assert [r["batch"] for r in res["peer"]["decode"]] == list(sizes.peer_batches)
    assert res["peer"]["prefill"]["tok_s"] > 0

    sv = res["serve"]
    assert sv["completed"] == sizes.serve[0] and sv["output_throughput"] > 0
    assert len(sv["first_ttft_ms_each"]) == sizes.serve_starts and sv["steady_ttft_ms"] > 0
    assert sv["prefix_cache"]["queries"] > 0 and sv["forward_steps"]

    text = capsys.readouterr().out
    assert "replay ms" in text and "transformers prefill" in text and "warm start" in text
    curves = P.Curves.from_json(res)  # the planner reads the suite's result as it is
    assert curves.prefill_s(64) > 0 and curves.decode


def test_unknown_section_and_missing_checkpoint_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    suite = load_script("gpu_suite")
    with pytest.raises(SystemExit):
        suite.main(["--device", "cpu", "--out", "x.json", "--sections", "decode,nope"])
    with pytest.raises(SystemExit):
        suite.main(["--out", "x.json"])  # cuda without --ckpt
    err = capsys.readouterr().err
    assert "nope" in err and "--ckpt is needed" in err
