"""CPU smoke runs of the benchmark scripts (benchmarks/*.py) that measure on the H200:
each runs its own code paths on a tiny Llama, so a renamed key, field or signature fails
here rather than in a device call. Numbers are not checked, only that every part ran and
wrote what its table reads. (gpu_suite: test_gpu_suite.py; pytest_table:
test_pytest_table.py; the Triton benches: tests/kernels/test_*_bench.py.)"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from _ports import free_port, free_ports
from _scripts import BENCHMARKS, load_script
from _stand_in_graphs import stand_in_graphs


def _script(name: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<name>.py args`` in a fresh interpreter (as the device runs it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, str(BENCHMARKS / f"{name}.py"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_structured_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("structured_bench")
    out = tmp_path / "s.json"
    argv = ["--device", "cpu", "--out", str(out), "--batch", "4", "--prompt-len", "16"]
    assert bench.main([*argv, "--steps", "4"]) == 0
    res = json.loads(out.read_text())
    assert [r["variant"] for r in res["runs"]] == list(bench.VARIANTS)
    for r in res["runs"]:
        assert r["tokens"] > 0 and r["running_during_timing"] == [4, 4] and r["vs_free"] > 0
    assert "json_schema:land_first" in capsys.readouterr().out


def test_transfer_bench_over_tcp_with_the_equality_part(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    done = _script(
        "transfer_bench", "--device", "cpu", "--layers", "2", "--heads", "2", "--head-dim",
        "16", "--lens", "64,256", "--reps", "2", "--transports", "tcp",
        "--equality-transport", "tcp", "--variants", "before,after", "--out", str(out),
    )  # fmt: skip
    res = json.loads(out.read_text())
    rows = res["transfers"]
    assert [(r["transport"], r["variant"], r["prompt"]) for r in rows] == [
        ("tcp", v, n) for v in ("before", "after") for n in (64, 256)
    ]
    for r in rows:
        assert r["bytes"] > 0 and r["copy_ms"] > 0 and r["sequential_ms"] >= r["copy_ms"]
        assert r["rtt_ms"] > 0 and r["done_ms"] > 0 and r["transfer_ms"] > 0
        assert r["bound_ms"] > 0 and r["transfer_ratio"] > 0 and r["early"] is False  # tcp
    eq = res["tcp_equality"]
    assert eq["identical"] and eq["transfer_failures"] == 0 and eq["external_kv_tokens"] > 0
    assert eq["dtype"] == "float32"  # on a CPU (bf16 could flip a greedy near-tie)
    assert "xfer/bd" in done.stdout and "kern/bd" in done.stdout


def test_transfer_bench_over_real_nixl_in_host_memory(tmp_path: Path) -> None:
    """The nixl rows (one worker, and the default thread pool) and the sequential read's
    posted / landed times, over NIXL's UCX backend in host memory."""
    pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed")
    out = tmp_path / "t.json"
    done = _script(
        "transfer_bench", "--device", "cpu", "--layers", "2", "--heads", "2", "--head-dim",
        "16", "--lens", "64,256", "--reps", "2", "--transports", "nixl:0,nixl",
        "--no-equality", "--variants", "after", "--out", str(out),
    )  # fmt: skip
    rows = json.loads(out.read_text())["transfers"]
    assert [(r["transport"], r["prompt"]) for r in rows] == [
        (t, n) for t in ("nixl:0", "nixl") for n in (64, 256)
    ]
    for r in rows:
        assert r["post_ms"] > 0 and r["land_ms"] >= 0 and r["copy_ms"] > 0
    assert "nixl read (sequential)" in done.stdout and "posted" in done.stdout


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--copy-shapes", "8192:4"], "needs a CUDA --device"),
        (["--copy-shape", "8192:4"], "add cuda_ipc"),
        (["--copy-shape", "1000:4"], "power of two"),
        (["--variants", "sideways"], "unknown --variants"),
    ],
)
def test_transfer_bench_refuses_flags_it_cannot_honour(flags: list[str], why: str) -> None:
    cmd = [sys.executable, str(BENCHMARKS / "transfer_bench.py"), "--device", "cpu",
           "--transports", "tcp", "--out", "/nonexistent/t.json", *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and why in done.stderr, done.stderr[-2000:]


def test_pd_bench_runs_1p1d_and_colocated(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_script("pd_bench")
    monkeypatch.setattr(bench, "_port", free_port)  # below the ephemeral range
    out = tmp_path / "pd.json"
    argv = ["--ckpt", str(tiny_llama), "--device", "cpu", "--dtype", "float32",
            "--input-len", "16", "--output-len", "4", "--rates", "8", "--num-prompts", "4",
            "--transport", "tcp", "--log-dir", str(tmp_path / "logs"), "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["topology"], r["completed"], r["failed"]) for r in rows] == [
        ("1P1D", 4, 0),
        ("colocated", 4, 0),
    ]
    health = rows[0]["pd_health"]
    assert set(health) == {"prefill-0", "decode-0"}
    for counters in health.values():  # nothing failed, expired or left held
        assert counters == {name: 0.0 for name in bench.PD_COUNTERS}


@pytest.mark.parametrize("device", ["cpu", "0,1"])
def test_pd_bench_topologies_are_valid(tiny_llama: Path, device: str) -> None:
    """Every topology pd_bench can start is one the launcher accepts (checked without
    starting it), on CPUs and on two GPUs with a GPU each for prefill and decode."""
    from pdserve.serving.launch.topology import Topology

    bench = load_script("pd_bench")
    argv = ["--ckpt", str(tiny_llama), "--out", "x.json", "--device", device]
    if device != "cpu":
        argv += ["--prefill-device", "0", "--decode-device", "1"]
    args = bench.parse_args(argv + ["--topologies", ",".join(bench.TOPOLOGIES)])
    gpus = {"pd": 1 if device == "cpu" else 2, "colocated": 1, "replicas": 1, "tp": 1}
    if device != "cpu":
        gpus.update(replicas=2, tp=2)
    for kind in bench.TOPOLOGIES:
        topo = Topology.from_dict(bench.topology(args, kind))
        assert topo.instances, kind
        assert bench.num_gpus(args, kind) == gpus[kind], kind
    with pytest.raises(SystemExit):
        bench.parse_args(argv + ["--topologies", "pd,nope"])


def _knee(limit: int) -> Callable[[int], tuple[float, float]]:
    """Fast (TPOT 4 ms) while at most ``limit`` streams are open, slow (40 ms) above."""
    return lambda in_flight: (0.01, 0.004 if in_flight <= limit else 0.04)


def test_pd_bench_sla_search_against_a_fake_instance(
    fake_server: Callable[..., Any],
    tiny_llama: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--sla: the search of one topology and the comparison table, with the launcher
    stood in by a fake instance whose latency has a knee (a live SLA search takes
    minutes)."""
    bench = load_script("pd_bench")
    srv = fake_server(latency_of=_knee(3))
    port = urlparse(srv.url).port
    assert port is not None
    launched: list[Any] = []

    @contextlib.contextmanager
    def launcher(topo: Any, log_dir: Path | None = None) -> Iterator[None]:
        launched.append(topo)
        yield None

    monkeypatch.setattr(bench, "Launcher", launcher)
    monkeypatch.setattr(bench, "_port", lambda: port)
    out = tmp_path / "sla.json"
    argv = ["--ckpt", str(tiny_llama), "--device", "cpu", "--dtype", "float32",
            "--topologies", "colocated", "--sla", "--sla-start", "8", "--sla-tolerance", "0.5",
            "--sla-min-point-seconds", "0",
            "--num-prompts", "16", "--input-len", "8", "--output-len", "4", "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    (rec,) = json.loads(out.read_text())
    assert rec["label"] == "colocated" and rec["num_gpus"] == 1 and len(launched) == 1
    assert rec["points"] and "capacity" in rec
    assert "tok/s/GPU" in capsys.readouterr().out


def test_first_request(tiny_llama: Path, tmp_path: Path) -> None:
    bench = load_script("first_request")
    out = tmp_path / "f.json"
    argv = ["--ckpt", str(tiny_llama), "--out", str(out), "--devices", "cpu",
            "--port", str(free_port()), "--plan", "8,16", "--max-token-id", "500",
            "--dtype", "float32", "--max-model-len", "256"]  # fmt: skip
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in res["rows"]] == [8, 16]
    assert all(r["ttft_ms"] > 0 for r in res["rows"])
    assert res["serve_args"] == ["--dtype", "float32", "--max-model-len", "256"]


def test_gpu_diag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """First-request phases and the decode split (graph replay timed, CUDA graphs stood
    in) in process, then the two-instance transfer over tcp."""
    diag = load_script("gpu_diag")
    make = diag.make_engine

    def with_graphs(*args: object) -> object:
        llm = make(*args)
        stand_in_graphs(llm)
        return llm

    monkeypatch.setattr(diag, "make_engine", with_graphs)
    out = tmp_path / "d.json"
    ports = ",".join(map(str, free_ports(2)))
    argv = ["--device", "cpu", "--transport", "tcp", "--ports", ports, "--out", str(out)]
    assert diag.main(argv) == 0
    res = json.loads(out.read_text())
    assert "ipc_transfer_error" not in res, res.get("ipc_transfer_error")
    first = res["first_request"]["first"]
    assert {"prepare_inputs", "forward", "sample"} <= set(first)
    assert [d["batch"] for d in res["decode_split"]] == [1, 2]
    assert all(d["graph_replay_ms"] > 0 for d in res["decode_split"])
    rows = res["ipc_transfer"]
    assert [r["prompt_tokens"] for r in rows] == [16, 64]
    assert all(r["decode_text_ok"] and r["bytes"] > 0 and r["transfer_s"] > 0 for r in rows)
    with pytest.raises(SystemExit):  # cuda_ipc cannot run on a CPU
        diag.main(["--device", "cpu", "--out", str(out)])


def test_warm_diag(tmp_path: Path) -> None:
    """In its own interpreter: the script points TRITON_CACHE_DIR at a fresh folder."""
    out = tmp_path / "w.json"
    _script("warm_diag", "--device", "cpu", "--out", str(out))
    res = json.loads(out.read_text())
    assert [r["len"] for r in res["rows"]] == [33, 33, 32, 32, 17, 17, 1, 1]
    assert {"sdpa_flash_37", "gemms_37", "sdpa_default_45"} <= set(res["first_call_ms"])


def test_fp8_bench(tmp_path: Path) -> None:
    """Its own interpreter: ``--device cpu`` sets TRITON_INTERPRET before the Triton GEMM
    is imported (so it runs the same on a machine with a GPU). Both models, both
    variants; every key the GPU run's table and RESULTS read."""
    out = tmp_path / "fp8.json"
    argv = ("--device", "cpu", "--workdir", str(tmp_path), "--out", str(out))
    done = _script("fp8_bench", *argv, timeout=480)  # two models, interpreted GEMMs
    res = json.loads(out.read_text())
    assert [k for k in res if k.endswith("_error")] == []
    assert res["limits"]["fp8_matmul_flops"] > 0
    assert [g["tokens"] for g in res["gemm"]] == [1, 16]
    assert all(
        g["triton_fp8_ms"] > 0 and g["triton_fp8_prequant_ms"] > 0 and g["bf16_ms"] > 0
        and g["timing"] in ("graph", "eager")
        for g in res["gemm"]
    )
    assert list(res["models"]) == ["llama-8b-shape", "glm5-m12-e64"]
    for model, m in res["models"].items():
        v = m["variants"]
        assert set(v) == {"bf16", "fp8"}, model
        assert v["fp8"]["kv_bytes_per_token"] < v["bf16"]["kv_bytes_per_token"]
        assert v["fp8"]["weight_bytes"] < v["bf16"]["weight_bytes"]
        assert v["bf16"]["fp8_activation_producers"] == 0
        assert v["fp8"]["fp8_activation_producers"] > 0
        for r in v.values():
            assert [(d["batch"], d["ctx"]) for d in r["decode"]] == [
                tuple(p) for p in m["decode_points"]
            ]
            for d in r["decode"]:
                assert d["step_ms"] > 0 and d["roofline_ms"] > 0 and d["ratio"] > 0
                assert d["path"] in ("graph", "eager", "mixed") and d["tok_s"] > 0
            assert [p["tokens"] for p in r["prefill"]] == m["prefill_lens"]
            for p in r["prefill"]:
                assert p["tok_s"] > 0 and p["share_of_fp8_peak"] > 0 and p["roofline_s"] > 0
                assert p["share_of_matmul_peak"] > 0 and p["ratio"] > 0
            off = r["offline"]
            assert off["output_tok_s"] > 0 and r["cudagraph_mode"]
            assert off["steps"] >= 1 and sum(off["step_paths"].values()) == off["steps"]
            assert off["profile"]["kernels"] > 0 and off["profile"]["categories"]
            assert "first_pass_compiles" in off and "kernel_compiles" in off
            assert off["first_pass_variants"].keys() == off["first_pass_compiles"].keys()
            pp = r["prefill_profile"]
            assert pp["tokens"] == m["prefill_lens"][0] and pp["kernels"] > 0
            assert pp["categories"] and pp["top"]
        if model == "llama-8b-shape":
            assert all(r["prefill_step"]["share_of_fp8_peak"] > 0 for r in v.values())
            assert all(d["kernels"]["kernels_per_step"] > 0 for r in v.values() for d in r["decode"])
            assert all(d["async_ratio"] > 0 for r in v.values() for d in r["decode"])
    assert "offline out tok/s" in done.stdout and "decode 2x24" in done.stdout
    assert "fp8 prefill" in done.stdout and "profile (ms)" in done.stdout
    assert "fp8 offline:" in done.stdout


def test_kernels_bench(tmp_path: Path) -> None:
    """Every section and the sweeps, the kernels in the interpreter (its own
    interpreter process, as for fp8_bench)."""
    out = tmp_path / "k.json"
    _script("kernels_bench", "--device", "cpu", "--sections", "all", "--sweep", "--out", str(out))
    res = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in res["decode"]] == [(1, 40), (2, 40)]
    assert all(set(r["sweep_ms"]) == {"1", "2"} and r["ms"] > 0 for r in res["decode"])
    for r in res["decode_configs"]:  # the engine's own pick is among the timed configs
        assert r["engine_pick_us"] > 0 and len(r["top5"]) >= 2
    assert [(r["cached"], r["new"]) for r in res["prefill"]] == [(0, 24), (16, 8)]
    assert res["prefill"][0]["sdpa_ms"] > 0 and len(res["prefill"][1]["sweep_ms"]) == 5
    for name in ("flash", "flash_gqa", "cudnn", "cudnn_gqa"):  # timed, or why not
        row = res["prefill"][0]
        assert row.get(f"{name}_TFLOPs", 0) > 0 or f"{name}_error" in row
    assert res["prefill"][0]["flash_gqa_diff"] < 1e-5  # the CPU's flash kernel runs it
    assert {(r["batch"], r["mode"]) for r in res["sampling"]} == {
        (b, m) for b in (1, 2) for m in ("top_p", "top_k+top_p")
    }
    assert [r["op"] for r in res["norm"]] == ["fused_add_rmsnorm", "rope"]
    assert {r["kv_dtype"] for r in res["decode"]} == {"float32"}
    fp8 = tmp_path / "k8.json"  # the decode sections over an fp8 cache
    _script("kernels_bench", "--device", "cpu", "--sections", "decode,decode_configs",
            "--kv-dtype", "fp8", "--config-ctx", "24", "--batches", "2", "--out", str(fp8))  # fmt: skip
    res8 = json.loads(fp8.read_text())
    assert {r["kv_dtype"] for r in res8["decode"] + res8["decode_configs"]} == {"float8_e4m3fn"}
    assert {r["batch"] for r in res8["decode"] + res8["decode_configs"]} == {2}
    # at --config-ctx 24: K and V of 2 requests x 24 tokens x 2 KV heads x 16 dims, 1 byte
    want_us = 2 * 2 * 24 * 2 * 16 / (res8["copy_bandwidth_GBps"] * 1e9) * 1e6
    assert res8["decode_configs"][0]["roofline_us"] == pytest.approx(want_us)
    # the pick's pipelining depth is the cache type's (decode_attention.num_stages)
    assert {r["engine_pick"]["stages"] for r in res["decode_configs"]} == {2}
    assert {r["engine_pick"]["stages"] for r in res8["decode_configs"]} == {1}
    assert all(r["ms"] > 0 for r in res8["decode"])
    # decode over fp8 beside the same launch with bf16 MMAs (decode_attention.FP8_HALF off)
    assert all(
        r["ms"] in r["fp8_half"].values() and min(r["fp8_half"].values()) > 0
        for r in res8["decode"]
    )


def test_skinny_bench(tmp_path: Path) -> None:
    """Every projection x rows with cuBLAS and the sweep, and the prologue rows (the
    kernels in the interpreter, tiny shapes)."""
    out = tmp_path / "s.json"
    _script("skinny_bench", "--device", "cpu", "--rows", "1,3", "--fp8", "--out", str(out))
    res = json.loads(out.read_text())
    assert [r["rows"] for r in res["layer"]] == [1, 3]
    assert all(r["skinny_ms"] > 0 and r["off_ms"] > 0 and r["weight_bytes"] > 0
               for r in res["layer"])  # fmt: skip
    # one row also with the norms folded in one pass; every mode computes off's layers
    assert res["layer"][0]["skinny_norm1p_ms"] > 0 and "skinny_norm1p_ms" not in res["layer"][1]
    assert all(r[k] < 1e-4 for r in res["layer"] for k in r if k.endswith("_max_diff"))
    assert [(r["proj"], r["rows"]) for r in res["gemm"]] == [
        (p, n) for p in ("qkv", "o", "gate_up", "down") for n in (1, 3)
    ]
    for r in res["gemm"]:
        assert r["cublas_ms"] > 0 and r["best"]["ms"] > 0 and r["best"]["max_err"] < 1e-4
        assert len(r["configs"]) == (5 if r["rows"] == 1 else 4)
        split = [c for c in r["configs"] if c["config"]["split_k"] == 2]
        assert len(split) == 1 and split[0]["max_err"] < 1e-4
    assert [(r["proj"], r["producer"]) for r in res["fused"][::2]] == [
        ("qkv", "rmsnorm"), ("gate_up", "rmsnorm"), ("down", "silu_mul")
    ]
    assert all(
        r["max_diff"] < 1e-4 and r["fused_ms"] > 0 and r["prefetch_flipped_ms"] > 0
        and r["default_config_ms"] > 0
        and (r["producer"] != "rmsnorm" or r["one_pass_norm"]["default"] > 0
             and r["one_pass_norm"]["max_diff"] < 1e-4)
        for r in res["fused"]
    )
    assert len(res["fp8"]) == 8 and all(
        r["triton_ms"] > 0 and r["default_config_ms"] > 0 and r["worst_err"] < 1e-3
        for r in res["fp8"]
    )


def test_pair_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 31's verdict from the r11 stages' files: medians per tree, current / baseline."""
    bench = load_script("pair_compare")

    def suite(ms: float, async_ms: float) -> dict:
        row = {"batch": 1, "ctx": 1024, "step_ms": ms, "async_step_ms": async_ms}
        return {"decode": [row, {"batch": 16, "ctx": 1024, "step_ms": ms}]}

    def glm5(ms: float) -> dict:
        return {"speed": [{"preset": "glm5-m12-e64", "decode": [{"batch": 32, "ctx": 1024,
                                                                 "step_ms": ms}]}]}  # fmt: skip

    files = {"r11_baseline_1": suite(8.0, 6.0), "r11_baseline_2": suite(8.2, 6.2),
             "r11_current_1": suite(8.1, 6.0), "r11_current_2": suite(8.3, 6.6),
             "r11g_baseline_1": glm5(20.0), "r11g_current_1": glm5(19.0)}  # fmt: skip
    for name, res in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
    (tmp_path / "r11_compare.json").write_text("{}")  # not a run: skipped
    out = tmp_path / "cmp.json"
    assert bench.main(["--dir", str(tmp_path), "--out", str(out)]) == 0
    rows = {r["point"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"llama b1 x1024 sync", "llama b1 x1024 async (default)",
                         "llama b16 x1024 sync", "glm5-m12-e64 b32 x1024"}  # fmt: skip
    sync = rows["llama b1 x1024 sync"]
    assert (sync["baseline_ms"], sync["current_ms"]) == (8.1, 8.2) and sync["ok"]
    late = rows["llama b1 x1024 async (default)"]
    assert late["ratio"] == pytest.approx(6.3 / 6.1) and not late["ok"]
    assert rows["glm5-m12-e64 b32 x1024"]["ratio"] == pytest.approx(0.95)
    assert "> 1.02" in capsys.readouterr().out
    assert bench.main(["--dir", str(tmp_path / "none")]) == 1


def test_host_phases(tiny_llama: Path, tmp_path: Path) -> None:
    """Issue 31's host breakdown of a synchronous step: every phase key, one row a batch,
    the batch running whole while it was timed."""
    out = tmp_path / "host.json"
    _script("host_phases", "--ckpt", str(tiny_llama), "--device", "cpu", "--out", str(out),
            "--batches", "1,3", "--ctx", "16", "--steps", "3", "--reps", "2", "--top", "4",
            "--max-model-len", "128", "--max-num-seqs", "8")  # fmt: skip
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        keys = {"schedule", "prepare", "replay", "triton", "wait", "update", "other", "step"}
        assert keys <= set(r) and r["step"] > 0 and r["prepare"] > 0 and r["schedule"] > 0
        assert r["running"] == r["batch"]
        assert r["syncs"] == {}  # no CUDA here: nothing to flag
        assert len(r["hot"]) == 4 and all(h["us_per_step"] > 0 for h in r["hot"])
    # a sync torch flags is put at the project's innermost line on the stack
    hp = load_script("host_phases")
    fake = tmp_path / "pdserve" / "runner" / "fake_step.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("import warnings\n\n\ndef step():\n"
                    "    warnings.warn('called a synchronizing CUDA operation')\n")  # fmt: skip
    spec = importlib.util.spec_from_file_location("fake_step", fake)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert hp.sync_sites(mod, 2) == {"pdserve/runner/fake_step.py:5": 1.0}
    diff = tmp_path / "diff.json"
    _script("host_phases", "--compare", str(out), str(out), "--out", str(diff))
    rows = json.loads(diff.read_text())
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(len(v) == 2 and v[0] == v[1] for r in rows for v in r["functions"].values())


# Scripts whose CPU smoke test covers only part of them (others edit them as of issue 29).
PARTIAL = {
    "glm5_kernels_bench": "--cpu-smoke runs its indexer sections only; the rest is CUDA only",
}


def test_every_benchmark_script_has_a_smoke_test() -> None:
    """Each benchmarks/*.py script (a file with a ``__main__`` entry; the others are
    modules the scripts import) is named by some test; PARTIAL says which run only in
    part."""
    tests = Path(__file__).resolve().parents[1]
    text = "\n".join(
        p.read_text() for p in tests.rglob("test_*.py") if p.name != Path(__file__).name
    )
    text += "\n".join(f'"{name}"' for name in PARTIAL)
    scripts = [
        p.stem
        for p in sorted(BENCHMARKS.glob("*.py"))
        if 'if __name__ == "__main__":' in p.read_text()
    ]
    mine = Path(__file__).read_text().split("# Scripts whose")[0]  # this file's tests only
    missing = [
        name
        for name in scripts
        if not any(f'"{name}"' in t or f"{name}.py" in t for t in (text, mine))
    ]
    assert missing == [], f"benchmark scripts without a CPU smoke test: {missing}"


def test_transfer_bench_places_the_early_copy_on_the_host_clock() -> None:
    """cuda_ipc's timeline (run on the GPU only): timing events placed by an anchor."""
    bench = load_script("transfer_bench")

    class Ev:
        def __init__(self, ms: float) -> None:
            self.ms = ms

        def elapsed_time(self, other: Ev) -> float:
            return other.ms - self.ms

    class Client:
        trace = [{"host_start": 10.0002, "host_launched": 10.0005, "events": [Ev(1.0), Ev(3.0)]}]

    class Link:
        transport, replied_at = Client(), 10.0009

    line = bench._timeline(Link(), 10.0, Ev(0.5), 10.0001)
    want = {"launched": 0.5, "launch_host": 0.3, "reply": 0.9, "gpu_start": 0.6, "gpu_end": 2.6}
    assert line == pytest.approx(want, abs=1e-6)
    Client.trace = []
    assert bench._timeline(Link(), 10.0, Ev(0.5), 10.0001) == {}
