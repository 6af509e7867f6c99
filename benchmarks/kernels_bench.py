"""GPU micro-benchmarks of the Triton kernels against their rooflines and torch paths.

Run on the GPU machine:

    PYTHONPATH=src python3 benchmarks/kernels_bench.py --out $OUT/kernels.json [--sections ...]

Sections (``--sections``, comma separated; default ``decode``; ``all`` for every one):
  decode    paged decode attention, Llama-3-8B shapes (32 q heads, 8 KV heads, D 128,
            bf16, block 16), batch 1/16/64 x context 1K/16K, vs the bytes-moved
            roofline at the measured copy bandwidth; ``--sweep`` also times every
            split count to check the heuristic; ``--kv-dtype fp8``: an fp8 e4m3 cache
            (here and in decode_configs; half the bytes)
  prefill   one prompt (8K new, 8000 new, and 4K cached + 4K new): Triton paged kernel
            vs torch SDPA on contiguous K/V, in TFLOP/s; with no cached prefix also each
            SDPA kernel alone (``sdpa_prefill(strict=True)``: flash / cuDNN, K/V heads
            expanded or shared by enable_gqa), cuDNN's first call at the length (its plan),
            and each one's largest difference to the default's output
  sampling  [B, 128256] float32 logits, top-p 0.9 (and top-k 50 + top-p): the
            sort-free kernel vs the runner's sort-based torch path
  norm      fused add + RMSNorm and RoPE at 4096 tokens x hidden 4096 vs torch
  decode_configs  every (splits, BLOCK_N, warps, stages) of the decode kernel beside the
            engine's pick, at context ``--config-ctx`` (default 1K)
``--batches 16,64``: the decode sections' batches (default 1, 16, 64).
Times are medians of ``triton.testing.do_bench``. Prints a table, writes JSON.

``--device cpu`` runs every section's code at tiny shapes (:data:`CPU`) with the kernels
in Triton's interpreter, timed by the host clock, and without CUDA graphs (``ms`` is then
the eager call too): a smoke run of the script (tests/bench/test_bench_scripts.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _graph import capture_calls  # noqa: E402


@dataclass(frozen=True)
class Shapes:
    """Every shape the sections use: Llama-3-8B's on the GPU, tiny ones on the CPU."""

    heads: int
    kv_heads: int
    head_dim: int
    page: int
    dtype: torch.dtype
    contexts: tuple[int, ...]  # decode
    batches: tuple[int, ...]  # decode, decode_configs
    sweep_splits: tuple[int, ...]
    config_grid: tuple[tuple[int, ...], ...]  # decode_configs: splits, BLOCK_N, warps, stages
    config_ctx: int
    graph_len: int  # max_model_len the engine's graphs size their split count for
    prefill: tuple[tuple[int, int], ...]  # (cached, new)
    sampling_vocab: int
    sampling_batches: tuple[int, ...]
    norm_tokens: int
    hidden: int
    rope_positions: int
    copy_elements: int


GPU = Shapes(
    heads=32, kv_heads=8, head_dim=128, page=16, dtype=torch.bfloat16, contexts=(1024, 16384),
    batches=(1, 16, 64), sweep_splits=(1, 2, 4, 8, 16, 32, 64),
    config_grid=((1, 2, 4, 8, 16, 32, 64), (32, 64, 128), (4, 8), (1, 2, 3)), config_ctx=1024,
    graph_len=20480, prefill=((0, 8192), (0, 8000), (4096, 4096)), sampling_vocab=128256,
    sampling_batches=(1, 16, 64, 128), norm_tokens=4096, hidden=4096, rope_positions=8192,
    copy_elements=1 << 29,
)  # fmt: skip
CPU = Shapes(
    heads=4, kv_heads=2, head_dim=16, page=16, dtype=torch.float32, contexts=(40,),
    batches=(1, 2), sweep_splits=(1, 2), config_grid=((1, 2), (32,), (4,), (1, 2)), config_ctx=40,
    graph_len=64, prefill=((0, 24), (16, 8)), sampling_vocab=512, sampling_batches=(1, 2),
    norm_tokens=8, hidden=64, rope_positions=64, copy_elements=1 << 16,
)  # fmt: skip
S = GPU  # the shapes in force (main sets them)
DEV = torch.device("cuda")
KV_DTYPE: torch.dtype | None = None  # --kv-dtype fp8: the decode sections' cache (else S.dtype)


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (on a CPU: of 3 host-clock calls after one)."""
    if DEV.type != "cuda":
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_graph(fn: Callable[[], object], reps: int = 20) -> float:
    """Median milliseconds of one ``fn`` call replayed from a CUDA graph of ``reps``
    back-to-back calls: GPU time without Python launch overhead (what a captured
    decode step pays). A CPU has no graphs: the eager call."""
    if DEV.type != "cuda":
        return bench(fn)
    return bench(capture_calls([fn] * reps).replay) / reps


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(S.copy_elements, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms * 1e-3)


def paged_cache(batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random cache with shuffled (fragmented) block tables for ``batch`` x ``ctx`` tokens."""
    nblk = -(-ctx // S.page)
    total = batch * nblk + 1
    cache = torch.randn(2, total, S.page, S.kv_heads, S.head_dim, device=DEV, dtype=S.dtype)
    if KV_DTYPE is not None:  # fp8 e4m3: the values stay in range (unit normal)
        cache = cache.to(KV_DTYPE)
    bt = (1 + torch.randperm(total - 1, device=DEV)).view(batch, nblk).to(torch.int32)
    return cache, bt


def decode_inputs(batch: int, ctx: int) -> tuple[torch.Tensor, ...]:
    """(cache, block tables, q, seq_lens, out, workspace) of a ``batch`` x ``ctx`` decode."""
    from pdserve.kernels.decode_attention import MAX_SPLITS, decode_workspace_numel

    cache, bt = paged_cache(batch, ctx)
    q = torch.randn(batch, S.heads, S.head_dim, device=DEV, dtype=S.dtype)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    ws = torch.empty(decode_workspace_numel(batch, S.heads, S.head_dim, MAX_SPLITS), device=DEV)
    return cache, bt, q, seq, torch.empty_like(q), ws


def run_decode(bw: float, sweep: bool) -> list[dict[str, object]]:
    from pdserve.kernels._utils import num_sms
    from pdserve.kernels.decode_attention import choose_num_splits, decode_attention

    rows = []
    sms = num_sms(DEV)
    hkv, d, el = S.kv_heads, S.head_dim, S.dtype.itemsize
    for ctx in S.contexts:
        for batch in S.batches:
            cache, bt, q, seq, out, ws = decode_inputs(batch, ctx)
            kv_el = cache.element_size()
            nbytes = 2 * batch * ctx * hkv * d * kv_el + 2 * q.numel() * el + bt.numel() * 4
            auto = choose_num_splits(batch, hkv, ctx, sms)

            run = partial(decode_attention, q, cache, seq, bt, d**-0.5, 1, batch)

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
                "kv_dtype": str(cache.dtype).removeprefix("torch."),
                "splits": auto,
                "ms": ms,
                "eager_ms": eager,
                "GB/s": nbytes / (ms * 1e-3) / 1e9,
                "roofline_ms": nbytes / bw * 1e3,
                "pct_roofline": 100 * nbytes / bw / (ms * 1e-3),
            }
            if KV_DTYPE is not None:  # the fp8 cache's MMAs: fp16 (FP8_HALF) or q's dtype
                import pdserve.kernels.decode_attention as da

                prev, da.FP8_HALF = da.FP8_HALF, not da.FP8_HALF
                try:
                    other = timed(auto)
                finally:
                    da.FP8_HALF = prev
                row["fp8_half"] = {"on": ms, "off": other} if prev else {"on": other, "off": ms}
            if sweep:
                row["sweep_ms"] = {s: timed(s) for s in S.sweep_splits}
            rows.append(row)
    return rows


def run_decode_configs(bw: float) -> list[dict[str, object]]:
    """Every (splits, BLOCK_N, warps, stages) of the decode kernel (attention + reduce) at
    1K context, batch 1/16/64, next to the engine's pick: its graphs size the split count
    for max_model_len (20480 in the suite), its tile config is ``_config``'s."""
    import pdserve.kernels.decode_attention as da
    from pdserve.kernels._utils import num_sms

    orig_config, orig_stages = da._config, (da.NUM_STAGES, da.NUM_STAGES_FP8)
    hkv, d = S.kv_heads, S.head_dim
    bm, dot, bn0, warps0 = orig_config(S.heads // hkv, d)
    rows: list[dict[str, object]] = []
    sms = num_sms(DEV)
    ctx = S.config_ctx
    try:
        for batch in S.batches:
            # the engine's settings again (the previous batch's sweep left its last config)
            da._config, (da.NUM_STAGES, da.NUM_STAGES_FP8) = orig_config, orig_stages
            cache, bt, q, seq, out, ws = decode_inputs(batch, ctx)
            pick = (da.choose_num_splits(batch, hkv, S.graph_len, sms), bn0, warps0,
                    da.num_stages(cache))  # fmt: skip
            times: dict[tuple[int, int, int, int], float] = {}
            grid = dict.fromkeys([*itertools.product(*S.config_grid), pick])  # the pick, timed
            for cfg in grid:
                splits, bn, warps, stages = cfg
                da._config = lambda m, d, c=(bm, dot, bn, warps): c
                da.NUM_STAGES = da.NUM_STAGES_FP8 = stages
                fn = partial(
                    da.decode_attention, q, cache, seq, bt, d**-0.5, 1, batch, splits, out, ws
                )
                times[cfg] = bench_graph(fn) * 1e3
            ranked = sorted(times, key=times.__getitem__)
            keys = ("splits", "block_n", "warps", "stages")
            rows.append(
                {
                    "batch": batch,
                    "engine_pick": dict(zip(keys, pick, strict=True)),
                    "engine_pick_us": times[pick],
                    "kv_dtype": str(cache.dtype).removeprefix("torch."),
                    "roofline_us": 2 * batch * ctx * hkv * d * cache.element_size() / bw * 1e6,
                    "top5": [
                        {**dict(zip(keys, c, strict=True)), "us": times[c]} for c in ranked[:5]
                    ],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        da._config, (da.NUM_STAGES, da.NUM_STAGES_FP8) = orig_config, orig_stages
    return rows


PREFILL_CONFIGS = [
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 64, 4, 4),
    (128, 64, 4, 3),
    (128, 128, 8, 3),
]


def sdpa_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flops: float) -> dict:
    """Each of ``SDPA_KERNELS`` alone (its order's first kernel only): TFLOP/s, its
    largest difference to the default's output, cuDNN's first call (ms: its plan, where
    the length's bucket has none yet), or the error where that kernel cannot run these
    shapes."""
    from pdserve.kernels.prefill_attention import SDPA_KERNELS, sdpa_prefill

    want = sdpa_prefill(q, k, v, q.shape[-1] ** -0.5).float()
    out: dict[str, object] = {}
    for name in SDPA_KERNELS:
        fn = partial(sdpa_prefill, q, k, v, q.shape[-1] ** -0.5, name, True)
        try:
            t0 = time.perf_counter()
            got = fn()
            if DEV.type == "cuda":
                torch.cuda.synchronize()
            first = (time.perf_counter() - t0) * 1e3
            out[f"{name}_TFLOPs"] = flops / bench(fn) / 1e9
        except RuntimeError as e:  # this kernel does not take these shapes here
            out[f"{name}_error"] = str(e).split("\n")[0][:120]
            continue
        out[f"{name}_diff"] = (got.float() - want).abs().max().item()
        if name.startswith("cudnn"):
            out[f"{name}_first_ms"] = first
    return out


def run_prefill(sweep: bool) -> list[dict[str, object]]:
    from pdserve.kernels.prefill_attention import prefill_attention, sdpa_prefill

    rows: list[dict[str, object]] = []
    h, hkv, d, dt = S.heads, S.kv_heads, S.head_dim, S.dtype
    for cached, new in S.prefill:
        n = cached + new
        cache, bt = paged_cache(1, n)
        q = torch.randn(new, h, d, device=DEV, dtype=dt)
        k = torch.randn(n, hkv, d, device=DEV, dtype=dt)
        v = torch.randn(n, hkv, d, device=DEV, dtype=dt)
        qsl = torch.tensor([0, new], dtype=torch.int32, device=DEV)
        seq = torch.tensor([n], dtype=torch.int32, device=DEV)
        flops = 4 * h * d * (new * cached + new * new / 2)
        ms = bench(partial(prefill_attention, q, cache, qsl, seq, bt, d**-0.5, 1, new, new))
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
                        prefill_attention, q, cache, qsl, seq, bt, d**-0.5, 1, new, new, config=cfg
                    )
                )
                for cfg in PREFILL_CONFIGS
            }
        if cached == 0:
            ms2 = bench(partial(sdpa_prefill, q, k, v, d**-0.5))
            row |= {"sdpa_ms": ms2, "sdpa_TFLOPs": flops / ms2 / 1e9}
            row |= sdpa_kernels(q, k, v, flops)
        rows.append(row)
    return rows


def run_sampling() -> list[dict]:
    from pdserve.kernels.sampling import sample, sample_reference

    rows = []
    vocab = S.sampling_vocab
    for batch in S.sampling_batches:
        logits = torch.randn(batch, vocab, device=DEV) * 3
        noise = torch.empty_like(logits).exponential_()
        temp = torch.full((batch,), 0.8, device=DEV)
        top_p = torch.full((batch,), 0.9, device=DEV)
        top_k = torch.full((batch,), 50, device=DEV, dtype=torch.int64)
        for name, tk in (("top_p", None), ("top_k+top_p", top_k)):
            ms = bench(partial(sample, logits, temp, tk, top_p, noise=noise))
            ref = bench(partial(sample_reference, logits, temp, tk, top_p, noise=noise))
            rows.append({"batch": batch, "mode": name, "triton_ms": ms, "torch_sort_ms": ref})
    return rows


def run_norm() -> list[dict]:
    from pdserve.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_reference
    from pdserve.kernels.rope import apply_rope, apply_rope_reference

    t, hidden, dt, el = S.norm_tokens, S.hidden, S.dtype, S.dtype.itemsize
    h, hkv, d = S.heads, S.kv_heads, S.head_dim
    x = torch.randn(t, hidden, device=DEV, dtype=dt)
    r = torch.randn_like(x)
    w = torch.rand(hidden, device=DEV, dtype=dt)
    nbytes = 4 * x.numel() * el  # read x, r; write out, residual
    ms = bench(lambda: fused_add_rmsnorm(x, r, w, 1e-5))
    ref = bench(lambda: fused_add_rmsnorm_reference(x, r, w, 1e-5))
    rows = [
        {"op": "fused_add_rmsnorm", "triton_ms": ms, "torch_ms": ref, "GB/s": nbytes / ms / 1e6}
    ]
    qkv = torch.randn(t, (h + 2 * hkv) * d, device=DEV, dtype=dt)
    q, k = qkv[:, : h * d], qkv[:, h * d : (h + hkv) * d]
    pos = torch.randint(0, S.rope_positions, (t,), device=DEV)
    cos = torch.randn(S.rope_positions, d // 2, device=DEV, dtype=dt)
    sin = torch.randn_like(cos)
    nbytes = 2 * (q.numel() + k.numel()) * el
    ms = bench(lambda: apply_rope(q, k, pos, cos, sin, d))
    ref = bench(lambda: apply_rope_reference(q, k, pos, cos, sin, d))
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


SECTIONS = ("decode", "decode_configs", "prefill", "sampling", "norm")


def main(argv: list[str] | None = None) -> int:
    global S, DEV, KV_DTYPE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--sections", default="decode", help=f"of {','.join(SECTIONS)}, or all")
    ap.add_argument("--sweep", action="store_true", help="time every decode split count")
    ap.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                    help="decode sections' KV cache: the shapes' dtype, or fp8 e4m3")  # fmt: skip
    ap.add_argument("--config-ctx", type=int, default=None,
                    help="decode_configs' context (default: 1024; CPU 40)")  # fmt: skip
    ap.add_argument("--batches", default=None,
                    help="the decode sections' batches, comma-separated (default: 1,16,64)")
    args = ap.parse_args(argv)
    chosen = set(SECTIONS) if args.sections == "all" else set(args.sections.split(","))
    if chosen - set(SECTIONS):
        ap.error(f"--sections: unknown {sorted(chosen - set(SECTIONS))}")
    cpu = args.device == "cpu"
    if cpu:  # the kernels in the interpreter: set before any kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if "pdserve.kernels.decode_attention" not in sys.modules:
            from _interp import interpreter_fix

            interpreter_fix()
    elif not torch.cuda.is_available():
        sys.exit("kernels_bench.py needs a CUDA GPU (--device cpu: the smoke run)")
    import triton

    S, DEV = (CPU, torch.device("cpu")) if cpu else (GPU, torch.device("cuda"))
    if args.config_ctx is not None:
        S = replace(S, config_ctx=args.config_ctx)
    if args.batches:
        S = replace(S, batches=tuple(int(b) for b in args.batches.split(",")))
    KV_DTYPE = torch.float8_e4m3fn if args.kv_dtype == "fp8" else None
    bw = copy_bandwidth()
    result: dict[str, object] = {
        "device": "cpu (interpreter)" if cpu else torch.cuda.get_device_name(),
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
    for name in SECTIONS:
        if name in chosen:
            rows = runners[name]()
            result[name] = rows
            table(name, rows)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
