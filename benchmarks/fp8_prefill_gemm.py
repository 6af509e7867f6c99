"""The block-FP8 GEMM at prefill sizes, every implementation in one call (issue 28).

    python3 benchmarks/fp8_prefill_gemm.py --out $OUT/fp8_prefill_gemm.json
    python3 benchmarks/fp8_prefill_gemm.py --device cpu --out /tmp/x.json      (smoke)

For the llama-8b projections (``down`` 4096 x 14336, ``gate_up`` 28672 x 4096, ``qkv``
6144 x 4096) at 2,048 / 8,192 / 16,384 tokens, with activations quantized by their
producer (an ``Fp8Activation``, as the engine's prefill feeds them), it times:

  triton      block_fp8_gemm at its default config (the engine's kernel today)
  triton_big  block_fp8_gemm with 128 x 128 tiles on 8 warps, grouped order
  gluon       fp8_gemm_gluon (kernels/fp8_gemm_gluon.py: the next K step's MMA issued
              before the previous step's partial is scaled); Hopper only
  scaled_mm   torch._scaled_mm with 1x128 / 128x128 block scales, where this PyTorch
              runs it (activations quantized by it: the engine's path from 256 tokens)
  bf16        torch.matmul on bf16 operands (cuBLAS), the same values dequantized

per point: ms (median of do_bench), TFLOP/s, the share of the fp8 matmul peak (one
``torch._scaled_mm`` 8192^3 with per-tensor scales, measured in the call; 2 M N K FLOP a
GEMM) and ``rel_err`` (max |out - reference| / max |reference|, the reference being the
float32 product of the dequantized operands, for bf16 of the unquantized activations and
the dequantized weights; above 2e-2 the point is marked bad).

``--device cpu`` runs a tiny shape under Triton's interpreter: the code path, not speed
(the Gluon kernel has no interpreter; its rows say it needs Hopper).
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
TOKENS = (2048, 8192, 16384)
CPU_SHAPES = {"tiny": (256, 256)}
CPU_TOKENS = (64,)
BAD = 2e-2


def _ms(fn: Callable[[], object], cuda: bool) -> float:
    if not cuda:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def fp8_peak(cuda: bool) -> float | None:
    """FLOP/s of ``torch._scaled_mm`` on 8192^3 fp8 with per-tensor scales (None on CPU)."""
    if not cuda:
        return None
    import torch

    s = 8192
    a = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = _ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), True)
    return 2 * s**3 / (ms / 1e3)


def entries(x: Any, xq: Any, w: Any, ws: Any, w_bf16: Any) -> list[tuple[str, Any]]:
    """(name, a callable or the reason it cannot run here) for one shape and M."""
    from pdserve.kernels import fp8_gemm, fp8_gemm_gluon
    from pdserve.layers.fp8 import _scaled_mm_usable

    big = fp8_gemm.Fp8GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=3,
                                 num_splits=1, group_m=8)  # fmt: skip
    out: list[tuple[str, Any]] = [
        ("triton", lambda: fp8_gemm.block_fp8_gemm(xq, w, ws)),
        ("triton_big", lambda: fp8_gemm.block_fp8_gemm(xq, w, ws, config=big)),
    ]
    if fp8_gemm_gluon.supported(xq, w, 128, None, x.dtype):
        out.append(("gluon", lambda: fp8_gemm_gluon.fp8_gemm_gluon(xq, w, ws, 128, x.dtype)))
    else:
        out.append(("gluon", "needs Hopper (sm_90) and producer-quantized activations"))
    if _scaled_mm_usable(x, w, 128):
        out.append(("scaled_mm", lambda: fp8_gemm.scaled_mm_block_fp8(x, w, ws, x.dtype)))
    else:
        out.append(("scaled_mm", "this PyTorch / device does not run the blockwise recipe"))
    out.append(("bf16", lambda: x @ w_bf16.t()))
    return out


def run(cuda: bool, budget_s: float) -> dict[str, Any]:
    import torch

    from pdserve.kernels.reference import (
        Fp8Activation,
        dequantize_fp8_blocks,
        quantize_fp8_blocks,
        quantize_fp8_groups,
    )

    dev = torch.device("cuda" if cuda else "cpu")
    end = time.perf_counter() + budget_s
    peak = fp8_peak(cuda)
    shapes, tokens = (SHAPES, TOKENS) if cuda else (CPU_SHAPES, CPU_TOKENS)
    rows: list[dict[str, Any]] = []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in shapes.items():
        w, ws = quantize_fp8_blocks(torch.randn(n, k, device=dev, generator=g), (128, 128))
        w_deq = dequantize_fp8_blocks(w, ws, (128, 128))  # float32
        w_bf16 = w_deq.to(torch.bfloat16)
        for m in tokens:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            q, scale = quantize_fp8_groups(x)
            xq = Fp8Activation(q, scale, torch.bfloat16)
            ref = xq.dequantize().float() @ w_deq.t()
            ref_bf16 = x.float() @ w_deq.t()  # bf16's own operands: no activation quantization
            flops = 2 * m * n * k
            for label, fn in entries(x, xq, w, ws, w_bf16):
                row: dict[str, Any] = {"shape": name, "m": m, "n": n, "k": k, "impl": label}
                if isinstance(fn, str):
                    rows.append({**row, "skipped": fn})
                    continue
                if time.perf_counter() > end:
                    rows.append({**row, "skipped": "budget"})
                    continue
                try:
                    got = fn().float()
                    want = ref_bf16 if label == "bf16" else ref
                    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
                    ms = _ms(fn, cuda)
                except Exception as e:  # a config that does not fit this GPU: its error
                    rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:160]}"})
                    continue
                row.update(ms=ms, tflops=flops / ms / 1e9, rel_err=err, bad=err > BAD)
                row["share_of_fp8_peak"] = flops / (ms * 1e-3) / peak if peak else None
                rows.append(row)
                print(json.dumps(row), flush=True)
            del x, q, scale, xq, ref, ref_bf16
        del w, ws, w_deq, w_bf16
        if cuda:
            torch.cuda.empty_cache()
    return {"fp8_peak_flops": peak, "rows": rows}


def print_table(res: dict[str, Any]) -> None:
    peak = res["fp8_peak_flops"]
    print(f"\n== fp8 GEMM at prefill sizes (fp8 peak {peak / 1e12:.0f} TFLOP/s)" if peak else
          "\n== fp8 GEMM at prefill sizes (CPU: no peak)")  # fmt: skip
    print(f"{'shape':>8} {'M':>6} {'impl':>11} {'ms':>8} {'TFLOP/s':>8} {'peak':>5} {'rel err':>8}")
    for r in res["rows"]:
        head = f"{r['shape']:>8} {r['m']:>6} {r['impl']:>11}"
        if "ms" not in r:
            print(f"{head} {r.get('skipped', r.get('error'))}")
            continue
        share = f"{r['share_of_fp8_peak']:5.0%}" if r["share_of_fp8_peak"] else "    -"
        flag = " BAD" if r["bad"] else ""
        print(f"{head} {r['ms']:8.3f} {r['tflops']:8.0f} {share} {r['rel_err']:8.1e}{flag}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from _interp import interpreter_fix

        interpreter_fix()
    res = run(cuda, args.budget_s)
    print_table(res)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
