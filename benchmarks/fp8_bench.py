"""FP8 on the GPU (issue 19): llama-8b-shape in bf16 and in block-scaled FP8, side by side.

    python3 benchmarks/fp8_bench.py --out $OUT/fp8_bench.json

Makes no weights file: the llama-8b-shape config and tokenizer are written to
``--workdir`` (``make-checkpoint --config-only``) and both engines draw the same random
values on the GPU (``--load-format dummy``); the FP8 engine quantizes them as it loads
(``--quantization fp8``: the values ``make-checkpoint --quantization fp8`` writes) and
keeps its KV cache in fp8 (``--kv-cache-dtype fp8``).

Measured in one call, on the card it runs on:
  limits   copy bandwidth and bf16 matmul rate (gpu_suite.measure_limits), and the FP8
           matmul peak: torch._scaled_mm, 8192^3, per-tensor scales
  gemm     one llama-8b-shape linear (down_proj, 4096 x 14336) at 1/16/64/8192 tokens:
           the Triton block-FP8 kernel, torch._scaled_mm with 128x128 block scales
           (where this PyTorch supports it) and bf16, against the byte roofline
  decode   decode step at batch 1/16/64 x 1K and 16 x 16K against the roofline (weight +
           KV bytes read over the measured copy bandwidth): gpu_suite.bench_decode; the
           FP8 engine's weight and KV bytes are its own, so the roofline is the FP8 one
  prefill  one 8K prompt: tok/s and TFLOP/s against the bf16 and the FP8 matmul peaks
  offline  128 prompts x 512 in / 128 out: output tok/s (the serve-shaped number; the
           HTTP serve run is gpu_suite's serve section with --serve-args)
Prints one table (bf16 | fp8 per row) and writes every number to ``--out``. About 3
minutes on an H200.

``--device cpu`` runs every part on the tiny Llama's config at gpu_suite's CPU sizes, the
Triton GEMM in the interpreter (``TRITON_INTERPRET=1`` is set before the kernels are
imported; tests/kernels/test_fp8_bench.py runs it): a smoke run, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_suite import (  # noqa: E402
    CPU_SIZES,
    GPU_SIZES,
    Sizes,
    _timed,
    bench_decode,
    bench_prefill,
    bench_throughput,
    kv_bytes_per_token,
    measure_limits,
    weight_bytes,
)

from pdserve import LLM  # noqa: E402
from pdserve.testing.checkpoint import make_checkpoint  # noqa: E402

# (decode points, GEMM (n, k), GEMM token counts) on the GPU and in the CPU smoke run
GPU_POINTS = (((1, 1024), (16, 1024), (64, 1024), (16, 16384)), (4096, 14336), (1, 16, 64, 8192))
CPU_POINTS = (((1, 24), (2, 24)), (256, 384), (1, 16))
VARIANTS = {
    "bf16": {},
    "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def _time_ms(fn: Callable[[], object], dev: torch.device, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return statistics.median(_timed(fn, dev) for _ in range(reps)) * 1e3


def fp8_matmul_peak(dev: torch.device, m: int = 8192) -> float:
    """FLOP/s of torch._scaled_mm on fp8 e4m3 operands with per-tensor scales."""
    a = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn).t()  # column-major operand
    one = torch.ones((), device=dev)
    ms = _time_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), dev, 10)
    return 2 * m**3 / (ms / 1e3)


def bench_gemm(
    limits: dict, dev: torch.device, shape: tuple[int, int], tokens: tuple[int, ...]
) -> list[dict]:
    """down_proj's FP8 GEMM (``shape`` = (n, k)) at each token count: Triton, scaled_mm
    and bf16 against the byte roofline."""
    from pdserve.kernels.fp8_gemm import block_fp8_gemm, scaled_mm_block_fp8
    from pdserve.kernels.reference import quantize_fp8_blocks

    n, k = shape
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_fp8_blocks(w, (128, 128))
    bw = limits["copy_bandwidth_Bps"]
    out = []
    for m in tokens:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        row: dict = {"tokens": m, "n": n, "k": k}
        row["bf16_ms"] = _time_ms(lambda x=x: x @ w.t(), dev)
        row["triton_fp8_ms"] = _time_ms(lambda x=x: block_fp8_gemm(x, wq, ws), dev)
        try:
            row["scaled_mm_fp8_ms"] = _time_ms(
                lambda x=x: scaled_mm_block_fp8(x, wq, ws, torch.bfloat16), dev
            )
        except Exception as e:  # the blockwise recipe needs a recent PyTorch on Hopper
            row["scaled_mm_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        row["fp8_roofline_ms"] = (n * k + 2 * m * k + 2 * m * n) / bw * 1e3
        row["bf16_roofline_ms"] = (2 * n * k + 2 * m * k + 2 * m * n) / bw * 1e3
        row["tflops_triton"] = 2 * m * n * k / row["triton_fp8_ms"] / 1e9
        out.append(row)
    return out  # the weights go with this frame; bench_variant empties the cache


def bench_variant(
    ckpt: Path, name: str, limits: dict, args: argparse.Namespace, sizes: Sizes, points: tuple
) -> dict:
    kw: dict = dict(dtype=sizes.dtype, load_format="dummy", max_model_len=sizes.max_model_len,
                    max_num_batched_tokens=sizes.max_num_batched_tokens)  # fmt: skip
    if args.device == "cpu":
        kw.update(device="cpu", max_num_seqs=sizes.max_num_seqs)
    else:
        kw.update(max_num_seqs=64, kv_cache_memory_bytes=args.kv_cache_gb * 2**30,
                  compilation_config={"cudagraph_capture_sizes": [1, 16, 64]})  # fmt: skip
    t0 = time.perf_counter()
    llm = LLM(str(ckpt), **kw, **VARIANTS[name])
    res: dict = {
        "startup_s": time.perf_counter() - t0,
        "weight_bytes": weight_bytes(llm),
        "kv_bytes_per_token": kv_bytes_per_token(llm),
        "cudagraph_mode": llm.engine.runner.graph_mode(),
    }
    res["decode"] = []
    for batch, ctx in points:
        r = bench_decode(llm, batch, ctx, limits, steps=12)
        print(name, json.dumps(r), flush=True)
        res["decode"].append(r)
    res["prefill"] = bench_prefill(llm, limits, sizes.prefill_len)
    res["prefill"]["share_of_fp8_peak"] = (
        res["prefill"]["tflops"] * 1e12 / limits["fp8_matmul_flops"]
    )
    print(name, json.dumps(res["prefill"]), flush=True)
    num, inp, out = sizes.throughput
    res["offline"] = bench_throughput(llm, num=num // 2, inp=inp, out=out)
    print(name, json.dumps(res["offline"]), flush=True)
    llm.engine.shutdown()
    del llm
    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return res


def print_table(res: dict) -> None:
    lim = res["limits"]
    print(
        f"\n== {res['gpu']} | torch {res['torch']} | copy {lim['copy_bandwidth_Bps'] / 1e12:.2f} TB/s"
        f" | bf16 matmul {lim['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s"
        f" | fp8 matmul {lim['fp8_matmul_flops'] / 1e12:.0f} TFLOP/s"
    )
    g0 = (res.get("gemm") or [{"n": 0, "k": 0}])[0]
    title = f"gemm {g0['n']}x{g0['k']}"
    print(f"{title:<18} {'bf16 ms':>9} {'triton ms':>10} {'scaled_mm':>10} {'fp8 roof':>9}")
    for g in res.get("gemm", []):
        sm = g.get("scaled_mm_fp8_ms")
        print(
            f"{g['tokens']:>18} {g['bf16_ms']:>9.3f} {g['triton_fp8_ms']:>10.3f}"
            f" {'n/a' if sm is None else f'{sm:.3f}':>10} {g['fp8_roofline_ms']:>9.3f}"
        )
    v = res["variants"]
    names = [n for n in VARIANTS if n in v]
    print(f"{'':<18} " + " ".join(f"{n:>28}" for n in names))
    print(f"{'weights GB':<18} " + " ".join(f"{v[n]['weight_bytes'] / 1e9:>28.2f}" for n in names))
    print(f"{'KV B/token':<18} " + " ".join(f"{v[n]['kv_bytes_per_token']:>28}" for n in names))
    for i, (batch, ctx) in enumerate(res["decode_points"]):
        cells = []
        for n in names:
            r = v[n]["decode"][i]
            cells.append(
                "skipped"
                if "skipped" in r
                else f"{r['step_ms']:.2f}/{r['roofline_ms']:.2f} ms x{r['ratio']:.2f}"
            )
        print(f"{f'decode {batch}x{ctx}':<18} " + " ".join(f"{c:>28}" for c in cells))
    cells = []
    for n in names:
        p = v[n]["prefill"]
        cells.append(
            f"{p['tok_s']:.0f} tok/s {p['share_of_matmul_peak']:.0%}bf {p['share_of_fp8_peak']:.0%}f8"
        )
    title = f"prefill {res['prefill_len']}"
    print(f"{title:<18} " + " ".join(f"{c:>28}" for c in cells))
    print(
        f"{'offline out tok/s':<18} "
        + " ".join(f"{v[n]['offline']['output_tok_s']:>28.0f}" for n in names)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--workdir", default="/tmp/pdserve-fp8-bench", help="config + tokenizer")
    ap.add_argument(
        "--kv-cache-gb",
        type=int,
        default=40,
        help="KV cache per engine, GiB (bf16 16 x 16K needs 33)",
    )
    ap.add_argument("--variants", default="bf16,fp8")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if cpu:  # the Triton GEMM in the interpreter: set before any kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if "pdserve.kernels.fp8_gemm" not in sys.modules:
            from _interp import interpreter_fix

            interpreter_fix()
    sizes, (points, shape, tokens) = (CPU_SIZES, CPU_POINTS) if cpu else (GPU_SIZES, GPU_POINTS)
    dev = torch.device(args.device)
    t0 = time.perf_counter()
    preset = "tiny" if cpu else "llama-8b-shape"
    ckpt = make_checkpoint("LlamaForCausalLM", preset, Path(args.workdir), config_only=True)
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": "cpu" if cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "decode_points": points,
        "prefill_len": sizes.prefill_len,
        "variants": {},
    }
    res["limits"] = measure_limits(args.device, sizes)
    res["limits"]["fp8_matmul_flops"] = fp8_matmul_peak(dev, sizes.matmul_m)
    print(json.dumps(res["limits"]), flush=True)
    res["gemm"] = bench_gemm(res["limits"], dev, shape, tokens)
    if not cpu:
        torch.cuda.empty_cache()
    print(json.dumps(res["gemm"]), flush=True)
    for name in args.variants.split(","):
        try:
            res["variants"][name] = bench_variant(ckpt, name, res["limits"], args, sizes, points)
        except Exception as e:
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"
            print(name, "failed:", res[f"{name}_error"], flush=True)
        Path(args.out).write_text(json.dumps(res, indent=2))  # partial results survive a kill
    res["seconds"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(res, indent=2))
    print_table(res)
    print(f"\n{res['seconds']:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
