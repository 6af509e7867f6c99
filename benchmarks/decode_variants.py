"""Decode-step variants side by side on one loaded engine, and the cost of cuBLAS's first
call at a new M (what the first request after start-up pays).

decode: for each batch (1K context), the requests are prefilled once; then for each
variant (L2 prefetch of o_proj off/on with several program counts, K/V loads with and
without the evict-first hint) a CUDA graph of that batch is captured, and its replay
time (device) and the engine step time with it (host clock, synchronous) are measured.

gemm: first vs second call of each layer GEMM at token counts never seen, before and
after a warm-up sweep of M; and the same in fresh processes with CUDA_MODULE_LOADING
LAZY vs EAGER (start-up time, memory).

    python3 benchmarks/decode_variants.py --ckpt /tmp/llama-8b --out $OUT/variants.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pdserve import LLM  # noqa: E402
from pdserve.kernels import decode_attention as da  # noqa: E402
from pdserve.layers.prefetch import PREFETCH  # noqa: E402
from pdserve.runner.cuda_graph import CudaGraphManager  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_suite import _add, _drain, kv_bytes_per_token, measure_limits, weight_bytes  # noqa: E402


def _replay_ms(g: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def decode_variants(llm: LLM, batch: int, ctx: int, variants: list[dict], limits: dict) -> list:
    eng = llm.engine
    r = eng.runner
    eng.set_async_scheduling(False)
    steps_needed = len(variants) * 14 + 20
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        _add(
            llm,
            f"v{batch}-{i}",
            torch.randint(10, 30000, (ctx,), generator=g).tolist(),
            steps_needed,
        )
    while eng.scheduler.waiting or any(
        not q.output_token_ids for q in eng.scheduler.requests.values()
    ):
        eng.step()
    padded = r.graphs.padded_size(batch, 1)
    base = r.graphs
    kv = batch * (ctx + 10) * kv_bytes_per_token(llm)
    roof_ms = (weight_bytes(llm) + kv) / limits["copy_bandwidth_Bps"] * 1e3
    rows = []
    for v in variants:
        PREFETCH.configure(v["prefetch"], v.get("ctas", 4096), 64, v.get("mode", "load"))
        da.KV_EVICTION_POLICY = v.get("kv_evict", "evict_first")
        mgr = CudaGraphManager(r, [padded])
        mgr.capture_all()
        r.graphs = mgr
        eng.step()  # refills the static inputs with the real batch (capture left dummies)
        replay = _replay_ms(mgr.graphs[(padded, 1)])
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        step = statistics.median(times) * 1e3
        rows.append(
            {
                "batch": batch,
                "ctx": ctx,
                **v,
                "replay_ms": replay,
                "step_ms": step,
                "roofline_ms": roof_ms,
                "replay_ratio": replay / roof_ms,
                "step_ratio": step / roof_ms,
                "running": len(eng.scheduler.running),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        r.graphs = base
    PREFETCH.configure(True, 32, 64)
    da.KV_EVICTION_POLICY = "evict_first"
    _drain(llm)
    return rows


def l2_gemm(llm: LLM) -> dict:
    """o_proj GEMM at M=1 with its weight cold (L2 flushed), hot (run just before), and
    after a prefetch of each kind plus a 20 us idle wait: the most a prefetch can win."""
    from pdserve.kernels.l2_prefetch import l2_prefetch, l2_prefetch_issue

    w = llm.engine.runner.model.model.layers[0].self_attn.o_proj.weight
    x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=w.device)
    sink = torch.zeros(4096, dtype=torch.int32, device=w.device)
    preps = {
        "cold": lambda: flush.zero_(),
        "hot": lambda: F.linear(x, w),
        "load": lambda: (flush.zero_(), l2_prefetch(w, sink[:132])),
        "bulk": lambda: (flush.zero_(), l2_prefetch_issue(w, sink, bulk=True)),
        "line": lambda: (flush.zero_(), l2_prefetch_issue(w, sink, bulk=False)),
    }
    out = {}
    for name, prep in preps.items():
        ts = []
        for _ in range(20):
            prep()
            torch.cuda._sleep(40000)  # ~20 us at 1.98 GHz
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            F.linear(x, w)
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) * 1e3)
        out[name + "_us"] = statistics.median(ts)
    print(json.dumps(out), flush=True)
    return out


def _first_second(fn) -> tuple[float, float]:
    out = []
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out[0], out[1]


def gemm_first_calls(llm: LLM) -> dict:
    layer = llm.engine.runner.model.model.layers[0]
    mats = {
        "qkv": layer.self_attn.qkv_proj.weight,
        "o": layer.self_attn.o_proj.weight,
        "gate_up": layer.mlp.gate_up_proj.weight,
        "down": layer.mlp.down_proj.weight,
    }

    def probe(ms: tuple[int, ...]) -> list:
        rows = []
        for m in ms:
            for name, w in mats.items():
                x = torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device)
                a, b = _first_second(lambda x=x, w=w: F.linear(x, w))
                rows.append(
                    {"m": m, "gemm": name, "first_ms": round(a, 3), "second_ms": round(b, 3)}
                )
        return rows

    res: dict = {"before_sweep": probe((1031, 777, 1500, 2900, 333, 5000))}
    t = time.perf_counter()
    sweep = list(range(16, 512, 16)) + list(range(512, 2048, 64)) + list(range(2048, 8193, 256))
    for m in sweep:
        for w in mats.values():
            F.linear(torch.empty(m, w.shape[1], dtype=w.dtype, device=w.device), w)
    torch.cuda.synchronize()
    res["sweep_s"] = time.perf_counter() - t
    res["sweep_points"] = len(sweep)
    res["after_sweep"] = probe((1037, 781, 1511, 2911, 339, 5003))
    return res


_CHILD = r"""
import time, json, os, torch, torch.nn.functional as F
t0 = time.perf_counter(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
init = time.perf_counter() - t0
free0, total = torch.cuda.mem_get_info()
w = torch.randn(14336 * 2, 4096, dtype=torch.bfloat16, device="cuda")
rows = []
for m in (16, 64, 256, 1024, 4096, 1031, 777, 2900):
    x = torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda")
    ts = []
    for _ in range(2):
        torch.cuda.synchronize(); t = time.perf_counter(); F.linear(x, w); torch.cuda.synchronize()
        ts.append(round((time.perf_counter() - t) * 1e3, 3))
    rows.append([m] + ts)
print(json.dumps({"mode": os.environ.get("CUDA_MODULE_LOADING"), "init_s": init,
                  "used_after_init_gb": (total - free0) / 1e9, "gemm_first_second_ms": rows}))
"""


def module_loading() -> list:
    out = []
    for mode in ("LAZY", "EAGER"):
        env = dict(os.environ, CUDA_MODULE_LOADING=mode)
        p = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300
        )
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-500:]
        print(line, flush=True)
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append({"mode": mode, "error": line})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--sections", default="l2,loading,gemm,decode")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(),
        "commit": os.environ.get("PDSERVE_COMMIT", "unknown"),
    }
    if "loading" in sections:
        res["module_loading"] = module_loading()
    res["limits"] = measure_limits()
    llm = LLM(
        args.ckpt,
        dtype="bfloat16",
        max_model_len=20480,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.85,
        max_num_seqs=256,
    )
    if "l2" in sections:
        res["l2_gemm"] = l2_gemm(llm)
    if "gemm" in sections:
        res["gemm"] = gemm_first_calls(llm)
        print(json.dumps(res["gemm"]), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    if "decode" in sections:
        variants = [{"prefetch": False}, {"prefetch": True, "mode": "bulk"}]
        variants += [{"prefetch": True, "mode": "line"}, {"prefetch": False, "kv_evict": ""}]
        variants += [{"prefetch": True, "mode": "bulk", "kv_evict": ""}]
        res["decode"] = []
        for b in map(int, args.batches.split(",")):
            res["decode"] += decode_variants(llm, b, 1024, variants, res["limits"])
            Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{'batch':>5} {'variant':<34} {'replay':>7} {'step':>7} {'roof':>6} {'ratio':>6}")
    for row in res.get("decode", []):
        name = json.dumps({k: row[k] for k in ("prefetch", "mode", "kv_evict") if k in row})
        print(
            f"{row['batch']:>5} {name:<34} {row['replay_ms']:7.3f} {row['step_ms']:7.3f} "
            f"{row['roofline_ms']:6.3f} {row['step_ratio']:6.3f}"
        )
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
