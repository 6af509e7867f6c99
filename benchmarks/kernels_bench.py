"""GPU micro-benchmarks of the Triton kernels against their rooflines and torch paths.

Run on the GPU machine:

    PYTHONPATH=src python3 benchmarks/kernels_bench.py --out $OUT/kernels.json [--sections ...]

Sections (``--sections``, comma separated; default ``decode``; ``all`` for every one):
  decode    paged decode attention, Llama-3-8B shapes (32 q heads, 8 KV heads, D 128,
            bf16, block 16), batch 1/16/64 x context 1K/16K, vs the bytes-moved
            roofline at the measured copy bandwidth; ``--sweep`` also times every
            split count to check the heuristic
  prefill   one prompt (8K new, and 4K cached + 4K new): Triton paged kernel vs
            torch SDPA on contiguous K/V, in TFLOP/s
  sampling  [B, 128256] float32 logits, top-p 0.9 (and top-k 50 + top-p): the
            sort-free kernel vs the runner's sort-based torch path
  norm      fused add + RMSNorm and RoPE at 4096 tokens x hidden 4096 vs torch
Times are medians of ``triton.testing.do_bench``. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pdserve.kernels._utils import num_sms  # noqa: E402
from pdserve.kernels.decode_attention import (  # noqa: E402
    MAX_SPLITS,
    choose_num_splits,
    decode_attention,
    decode_workspace_numel,
)
from pdserve.kernels.prefill_attention import prefill_attention, sdpa_prefill  # noqa: E402
from pdserve.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_reference  # noqa: E402
from pdserve.kernels.rope import apply_rope, apply_rope_reference  # noqa: E402
from pdserve.kernels.sampling import sample, sample_reference  # noqa: E402

H, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn``."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_graph(fn: Callable[[], object], reps: int = 20) -> float:
    """Median milliseconds of one ``fn`` call replayed from a CUDA graph of ``reps``
    back-to-back calls: GPU time without Python launch overhead (what a captured
    decode step pays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return bench(graph.replay) / reps


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms * 1e-3)


def paged_cache(batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random cache with shuffled (fragmented) block tables for ``batch`` x ``ctx`` tokens."""
    nblk = -(-ctx // PAGE)
    total = batch * nblk + 1
    cache = torch.randn(2, total, PAGE, HKV, D, device="cuda", dtype=DT)
    bt = (1 + torch.randperm(total - 1, device="cuda")).view(batch, nblk).to(torch.int32)
    return cache, bt


def decode_inputs(batch: int, ctx: int) -> tuple[torch.Tensor, ...]:
    """(cache, block tables, q, seq_lens, out, workspace) of a ``batch`` x ``ctx`` decode."""
    cache, bt = paged_cache(batch, ctx)
    q = torch.randn(batch, H, D, device="cuda", dtype=DT)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    ws = torch.empty(decode_workspace_numel(batch, H, D, MAX_SPLITS), device="cuda")
    return cache, bt, q, seq, torch.empty_like(q), ws


def run_decode(bw: float, sweep: bool) -> list[dict[str, object]]:
    rows = []
    sms = num_sms(torch.device("cuda"))
    for ctx in (1024, 16384):
        for batch in (1, 16, 64):
            cache, bt, q, seq, out, ws = decode_inputs(batch, ctx)
            nbytes = 2 * batch * ctx * HKV * D * 2 + 2 * q.numel() * 2 + bt.numel() * 4
            auto = choose_num_splits(batch, HKV, ctx, sms)

            run = partial(decode_attention, q, cache, seq, bt, D**-0.5, 1, batch)

            def timed(
                s: int,
                run: Callable[..., object] = run,
                out: torch.Tensor = out,
                ws: torch.Tensor = ws,
            ) -> float:
                return bench_graph(partial(run, s, out, ws))

            ms = timed(auto)
            eager = bench(partial(run, auto, out, ws))
            row: dict[str, object] = {
                "batch": batch,
                "context": ctx,
                "splits": auto,
                "ms": ms,
                "eager_ms": eager,
                "GB/s": nbytes / (ms * 1e-3) / 1e9,
                "roofline_ms": nbytes / bw * 1e3,
                "pct_roofline": 100 * nbytes / bw / (ms * 1e-3),
            }
            if sweep:
                row["sweep_ms"] = {s: timed(s) for s in (1, 2, 4, 8, 16, 32, 64)}
            rows.append(row)
    return rows


def run_decode_configs(bw: float) -> list[dict[str, object]]:
    """Every (splits, BLOCK_N, warps, stages) of the decode kernel (attention + reduce) at
    1K context, batch 1/16/64, next to the engine's pick: its graphs size the split count
    for max_model_len (20480 in the suite), its tile config is ``_config``'s."""
    import pdserve.kernels.decode_attention as da

    orig_config, orig_stages = da._config, da.NUM_STAGES
    bm, dot, bn0, warps0 = orig_config(H // HKV, D)
    rows: list[dict[str, object]] = []
    sms = num_sms(torch.device("cuda"))
    ctx = 1024
    try:
        for batch in (1, 16, 64):
            cache, bt, q, seq, out, ws = decode_inputs(batch, ctx)
            pick = (choose_num_splits(batch, HKV, 20480, sms), bn0, warps0, orig_stages)
            times: dict[tuple[int, int, int, int], float] = {}
            for cfg in itertools.product(
                (1, 2, 4, 8, 16, 32, 64), (32, 64, 128), (4, 8), (1, 2, 3)
            ):
                splits, bn, warps, stages = cfg
                da._config = lambda m, d, c=(bm, dot, bn, warps): c
                da.NUM_STAGES = stages
                fn = partial(
                    decode_attention, q, cache, seq, bt, D**-0.5, 1, batch, splits, out, ws
                )
                times[cfg] = bench_graph(fn) * 1e3
            ranked = sorted(times, key=times.__getitem__)
            keys = ("splits", "block_n", "warps", "stages")
            rows.append(
                {
                    "batch": batch,
                    "engine_pick": dict(zip(keys, pick, strict=True)),
                    "engine_pick_us": times[pick],
                    "roofline_us": 2 * batch * ctx * HKV * D * 2 / bw * 1e6,
                    "top5": [
                        {**dict(zip(keys, c, strict=True)), "us": times[c]} for c in ranked[:5]
                    ],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        da._config, da.NUM_STAGES = orig_config, orig_stages
    return rows


PREFILL_CONFIGS = [
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 64, 4, 4),
    (128, 64, 4, 3),
    (128, 128, 8, 3),
]


def run_prefill(sweep: bool) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for cached, new in ((0, 8192), (4096, 4096)):
        n = cached + new
        cache, bt = paged_cache(1, n)
        q = torch.randn(new, H, D, device="cuda", dtype=DT)
        k = torch.randn(n, HKV, D, device="cuda", dtype=DT)
        v = torch.randn(n, HKV, D, device="cuda", dtype=DT)
        qsl = torch.tensor([0, new], dtype=torch.int32, device="cuda")
        seq = torch.tensor([n], dtype=torch.int32, device="cuda")
        flops = 4 * H * D * (new * cached + new * new / 2)
        ms = bench(partial(prefill_attention, q, cache, qsl, seq, bt, D**-0.5, 1, new, new))
        row: dict[str, object] = {
            "cached": cached,
            "new": new,
            "triton_ms": ms,
            "triton_TFLOPs": flops / ms / 1e9,
        }
        if sweep:
            row["sweep_ms"] = {
                str(cfg): bench(
                    partial(
                        prefill_attention, q, cache, qsl, seq, bt, D**-0.5, 1, new, new, config=cfg
                    )
                )
                for cfg in PREFILL_CONFIGS
            }
        if cached == 0:
            ms2 = bench(partial(sdpa_prefill, q, k, v, D**-0.5))
            row |= {"sdpa_ms": ms2, "sdpa_TFLOPs": flops / ms2 / 1e9}
        rows.append(row)
    return rows


def run_sampling() -> list[dict]:
    rows = []
    vocab = 128256
    for batch in (1, 16, 64, 128):
        logits = torch.randn(batch, vocab, device="cuda") * 3
        noise = torch.empty_like(logits).exponential_()
        temp = torch.full((batch,), 0.8, device="cuda")
        top_p = torch.full((batch,), 0.9, device="cuda")
        top_k = torch.full((batch,), 50, device="cuda", dtype=torch.int64)
        for name, tk in (("top_p", None), ("top_k+top_p", top_k)):
            ms = bench(partial(sample, logits, temp, tk, top_p, noise=noise))
            ref = bench(partial(sample_reference, logits, temp, tk, top_p, noise=noise))
            rows.append({"batch": batch, "mode": name, "triton_ms": ms, "torch_sort_ms": ref})
    return rows


def run_norm() -> list[dict]:
    t, hidden = 4096, 4096
    x = torch.randn(t, hidden, device="cuda", dtype=DT)
    r = torch.randn_like(x)
    w = torch.rand(hidden, device="cuda", dtype=DT)
    nbytes = 4 * x.numel() * 2  # read x, r; write out, residual
    ms = bench(lambda: fused_add_rmsnorm(x, r, w, 1e-5))
    ref = bench(lambda: fused_add_rmsnorm_reference(x, r, w, 1e-5))
    rows = [
        {"op": "fused_add_rmsnorm", "triton_ms": ms, "torch_ms": ref, "GB/s": nbytes / ms / 1e6}
    ]
    qkv = torch.randn(t, (H + 2 * HKV) * D, device="cuda", dtype=DT)
    q, k = qkv[:, : H * D], qkv[:, H * D : (H + HKV) * D]
    pos = torch.randint(0, 8192, (t,), device="cuda")
    cos = torch.randn(8192, D // 2, device="cuda", dtype=DT)
    sin = torch.randn_like(cos)
    nbytes = 2 * (q.numel() + k.numel()) * 2
    ms = bench(lambda: apply_rope(q, k, pos, cos, sin, D))
    ref = bench(lambda: apply_rope_reference(q, k, pos, cos, sin, D))
    rows.append({"op": "rope", "triton_ms": ms, "torch_ms": ref, "GB/s": nbytes / ms / 1e6})
    return rows


def table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n== {title}")
    if not rows:
        return
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "sweep_ms"]
    print(" | ".join(f"{k:>13}" for k in keys))
    for row in rows:
        vals = [row.get(k, "") for k in keys]
        cells = [f"{v:13.4g}" if isinstance(v, float) else f"{v!s:>13}" for v in vals]
        print(" | ".join(cells))
        if "sweep_ms" in row:
            print("    sweep ms:", {s: round(v, 4) for s, v in row["sweep_ms"].items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--sections", default="decode")
    ap.add_argument("--sweep", action="store_true", help="time every decode split count")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_bench.py needs a CUDA GPU")
    sections = {"decode", "decode_configs", "prefill", "sampling", "norm"}
    chosen = sections if args.sections == "all" else set(args.sections.split(","))
    bw = copy_bandwidth()
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bandwidth_GBps": bw / 1e9,
    }
    print(f"{result['device']}: copy bandwidth {bw / 1e12:.2f} TB/s")
    runners = {
        "decode": lambda: run_decode(bw, args.sweep),
        "prefill": lambda: run_prefill(args.sweep),
        "sampling": run_sampling,
        "norm": run_norm,
        "decode_configs": lambda: run_decode_configs(bw),
    }
    for name in ("decode", "decode_configs", "prefill", "sampling", "norm"):
        if name in chosen:
            rows = runners[name]()
            result[name] = rows
            table(name, rows)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
