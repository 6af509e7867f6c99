"""The block-FP8 GEMM, every implementation in one call, at decode and prefill sizes
(issue 28).

    python3 benchmarks/fp8_gemm_compare.py --out $OUT/fp8_gemm_compare.json
    python3 benchmarks/fp8_gemm_compare.py --device cpu --out /tmp/x.json      (smoke)

For the llama-8b projections (``down`` 4096 x 14336, ``gate_up`` 28672 x 4096, ``qkv``
6144 x 4096), with activations quantized by their producer (an ``Fp8Activation``, as the
engine feeds them), it times:

  triton      block_fp8_gemm at its default config (the engine's kernel today)
  triton_big  (prefill only) block_fp8_gemm with 128 x 128 tiles on 8 warps, grouped order
  gluon       fp8_gemm_gluon (kernels/fp8_gemm_gluon.py): the swapped weight-streaming
              kernel for decode rows, the 128 x 128 tile kernel with cp.async copies for
              prefill; Hopper only
  gluon_tma   (prefill only) its 128 x 128 tile kernel with TMA copies
  gluon_ws    (prefill only) the warp-specialized, persistent tile kernel
              (kernels/fp8_gemm_gluon_ws.py; the engine's default)
  scaled_mm   (prefill only) torch._scaled_mm with 1x128 / 128x128 block scales, where
              this PyTorch runs it (activations quantized by it: the engine's path from
              256 tokens)
  bf16        torch.matmul on bf16 operands (cuBLAS), the same values dequantized

Decode (1, 16 and 64 rows): each call reads another copy of the weights (copies that
together exceed 3x the L2 cache, as a model's layers do), timed as one CUDA graph of one
call a copy; ``x_roof`` = time / (bytes / copy bandwidth), bytes = the weights (fp8:
values and scales; bf16: 2 bytes a weight) + activations in and out, the copy bandwidth
a 2 GiB device-to-device copy (read + written; ``gpu_suite.measure_limits``) measured
in the call. Prefill (2,048 / 8,192 / 16,384 tokens): median of do_bench; TFLOP/s and
the share of the fp8 matmul peak (``gpu_suite.fp8_matmul_flops``: ``torch._scaled_mm``
on 8192^3 with per-tensor scales, measured in the call; 2 M N K FLOP a GEMM).

Every point's ``rel_err`` is max |out - reference| / max |reference|, the reference the
float32 product of the dequantized operands (for bf16: of the unquantized activations and
the dequantized weights); above 2e-2 the point is marked bad.

``--device cpu`` runs tiny shapes under Triton's interpreter: the code path, not speed
(the Gluon kernels have no interpreter; their rows say they need Hopper).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = {"down": (4096, 14336), "gate_up": (28672, 4096), "qkv": (6144, 4096)}
DECODE = (1, 16, 64)
PREFILL = (2048, 8192, 16384)
CPU_SHAPES = {"tiny": (256, 256)}
CPU_DECODE = (3,)
CPU_PREFILL = (80,)
BAD = 2e-2


def _ms(fn: Callable[[], object], cuda: bool) -> float:
    if not cuda:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _graph_ms(calls: list[Callable[[], object]], cuda: bool) -> float:
    """One call's ms: a CUDA graph of every call once (each on its own weights), replayed."""
    if not cuda:
        return _ms(calls[0], False)
    from _graph import capture_calls

    return _ms(capture_calls(calls).replay, True) / len(calls)


def limits(cuda: bool) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written a second, gpu_suite's measurement) and the fp8
    matmul peak (gpu_suite.fp8_matmul_flops); None on the CPU."""
    if not cuda:
        return {"copy_Bps": None, "fp8_peak_flops": None, "l2_bytes": 0}
    import torch
    from gpu_suite import fp8_matmul_flops, measure_limits

    copy = measure_limits("cuda")["copy_bandwidth_Bps"]
    peak = fp8_matmul_flops("cuda")
    torch.cuda.empty_cache()
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)) or 50 << 20
    return {"copy_Bps": copy, "fp8_peak_flops": peak, "l2_bytes": l2}


def entries(m: int, xs: list[Any], xqs: list[Any], ws: list[tuple[Any, Any, Any]],
            decode: bool) -> list[tuple[str, Any]]:  # fmt: skip
    """(name, the calls (one a weight copy) or the reason it cannot run here)."""
    from pdserve.kernels import fp8_gemm, fp8_gemm_gluon
    from pdserve.layers.fp8 import _scaled_mm_usable

    x, xq = xs[0], xqs[0]
    out: list[tuple[str, Any]] = [
        ("triton", [lambda w=w, s=s: fp8_gemm.block_fp8_gemm(xq, w, s) for w, s, _ in ws])
    ]
    if not decode:
        big = fp8_gemm.Fp8GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=3,
                                     num_splits=1, group_m=8)  # fmt: skip
        out.append(("triton_big", [lambda w=w, s=s: fp8_gemm.block_fp8_gemm(xq, w, s, config=big)
                                   for w, s, _ in ws]))  # fmt: skip
    # the Gluon kernels: decode rows take the swapped kernel; prefill sizes each tile kernel
    kernels = [("gluon", "cp_async")] if decode else [
        ("gluon", "cp_async"), ("gluon_tma", "tma"), ("gluon_ws", "ws")]
    for label, kern in kernels:
        if fp8_gemm_gluon.supported(xq, ws[0][0], 128, None, x.dtype):
            out.append((label, [lambda w=w, s=s, kern=kern: fp8_gemm_gluon.fp8_gemm_gluon(
                xq, w, s, 128, x.dtype, kern) for w, s, _ in ws]))  # fmt: skip
        else:
            out.append((label, "needs Hopper (sm_90) and producer-quantized activations"))
    if not decode:
        if _scaled_mm_usable(x, ws[0][0], 128):
            out.append(("scaled_mm", [lambda w=w, s=s: fp8_gemm.scaled_mm_block_fp8(x, w, s, x.dtype)
                                      for w, s, _ in ws]))  # fmt: skip
        else:
            out.append(("scaled_mm", "this PyTorch / device does not run the blockwise recipe"))
    out.append(("bf16", [lambda wb=wb: x @ wb.t() for _, _, wb in ws]))
    return out


def run(cuda: bool, budget_s: float, prefill_only: bool = False,
        impls: frozenset[str] | None = None) -> dict[str, Any]:  # fmt: skip
    import torch

    from pdserve.kernels.reference import (
        Fp8Activation,
        dequantize_fp8_blocks,
        quantize_fp8_blocks,
        quantize_fp8_groups,
    )

    dev = torch.device("cuda" if cuda else "cpu")
    end = time.perf_counter() + budget_s
    lim = limits(cuda)
    shapes = SHAPES if cuda else CPU_SHAPES
    points = [] if prefill_only else [(m, True) for m in (DECODE if cuda else CPU_DECODE)]
    points += [(m, False) for m in (PREFILL if cuda else CPU_PREFILL)]
    rows: list[dict[str, Any]] = []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in shapes.items():
        w, s = quantize_fp8_blocks(torch.randn(n, k, device=dev, generator=g), (128, 128))
        w_deq = dequantize_fp8_blocks(w, s, (128, 128))  # float32
        w_bf16 = w_deq.to(torch.bfloat16)
        # decode: enough weight copies to exceed 3x L2 (bf16 copies too, for its own rows)
        copies = max(1, -(-3 * lim["l2_bytes"] // (n * k)))
        dec_ws = [(w, s, w_bf16)] + [(w.clone(), s.clone(), w_bf16.clone())
                                     for _ in range(copies - 1)]  # fmt: skip
        for m, decode in points:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            q, scale = quantize_fp8_groups(x)
            xq = Fp8Activation(q, scale, torch.bfloat16)
            ref = xq.dequantize().float() @ w_deq.t()
            ref_bf16 = x.float() @ w_deq.t()  # bf16's own operands: no activation quantization
            flops = 2 * m * n * k
            for label, calls in entries(m, [x], [xq], dec_ws if decode else [(w, s, w_bf16)],
                                        decode):  # fmt: skip
                if impls is not None and label not in impls:
                    continue
                row: dict[str, Any] = {"shape": name, "m": m, "n": n, "k": k, "impl": label,
                                       "phase": "decode" if decode else "prefill"}  # fmt: skip
                if isinstance(calls, str):
                    rows.append({**row, "skipped": calls})
                    continue
                if time.perf_counter() > end:
                    rows.append({**row, "skipped": "budget"})
                    continue
                try:
                    got = calls[0]().float()
                    want = ref_bf16 if label == "bf16" else ref
                    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
                    ms = _graph_ms(calls, cuda) if decode else _ms(calls[0], cuda)
                except Exception as e:  # a config that does not fit this GPU: its error
                    rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:160]}"})
                    continue
                wbytes = n * k * 2 if label == "bf16" else n * k + s.numel() * 4
                nbytes = wbytes + m * k * (2 if label == "bf16" else 1) + m * n * 2
                row.update(ms=ms, tflops=flops / ms / 1e9, rel_err=err, bad=err > BAD,
                           bytes=nbytes)  # fmt: skip
                bw, peak = lim["copy_Bps"], lim["fp8_peak_flops"]
                row["x_roof"] = ms / (nbytes / bw * 1e3) if bw else None
                row["share_of_fp8_peak"] = flops / (ms * 1e-3) / peak if peak else None
                rows.append(row)
                print(json.dumps(row), flush=True)
            del x, q, scale, xq, ref, ref_bf16
        del w, s, w_deq, w_bf16, dec_ws
        if cuda:
            torch.cuda.empty_cache()
    return {**lim, "rows": rows}


def print_table(res: dict[str, Any]) -> None:
    peak, bw = res["fp8_peak_flops"], res["copy_Bps"]
    head = (f"fp8 peak {peak / 1e12:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s" if peak and bw
            else "CPU: no limits")  # fmt: skip
    print(f"\n== fp8 GEMM, decode (x_roof: time over bytes / copy rate) and prefill "
          f"(share of the fp8 peak); {head}")  # fmt: skip
    print(f"{'shape':>8} {'M':>6} {'impl':>11} {'ms':>8} {'TFLOP/s':>8} {'x_roof':>6} "
          f"{'peak':>5} {'rel err':>8}")  # fmt: skip
    for r in res["rows"]:
        lead = f"{r['shape']:>8} {r['m']:>6} {r['impl']:>11}"
        if "ms" not in r:
            print(f"{lead} {r.get('skipped', r.get('error'))}")
            continue
        roof = f"{r['x_roof']:6.2f}" if r["x_roof"] else "     -"
        share = f"{r['share_of_fp8_peak']:5.0%}" if r["share_of_fp8_peak"] else "    -"
        flag = " BAD" if r["bad"] else ""
        print(f"{lead} {r['ms']:8.3f} {r['tflops']:8.1f} {roof} {share} {r['rel_err']:8.1e}{flag}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prefill-only", action="store_true", help="no decode points")
    ap.add_argument("--impls", default=None, help="comma-separated: only these (e.g. gluon_ws)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from _interp import interpreter_fix

        interpreter_fix()
    impls = frozenset(args.impls.split(",")) if args.impls else None
    res = run(cuda, args.budget_s, args.prefill_only, impls)
    print_table(res)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
