"""The decode-size GEMM (:mod:`pdserve.kernels.skinny_gemm`) beside cuBLAS, issue 30.

    PYTHONPATH=src python3 benchmarks/skinny_bench.py --out $OUT/skinny.json [--quick]

For each llama-8b-shape projection (qkv 6144 x 4096, o 4096 x 4096, gate|up 28672 x 4096,
down 4096 x 14336) at 1 / 16 / 64 rows:

- ``gemm``: torch's ``F.linear`` (cuBLAS) and every skinny config of the sweep (split-K
  among them where the column tiles are few), each as
  the per-call time of a CUDA graph of calls that cycle over enough weight copies that
  no call finds its weight in L2 (>= 200 MB; what a decode step pays); bytes = weight +
  input + output, against the device-to-device copy rate measured in the same call.
- ``fp8`` (``--fp8``): the same projections with block-FP8 weights (128 x 128 scales):
  the Triton block-FP8 GEMM the layers run today beside the skinny kernel's weight-only
  mode over a small sweep, against the copy rate for the fp8 bytes.
- ``fused``: the producer and the GEMM as the step launches them today (the fused
  add+RMSNorm kernel then cuBLAS for qkv and gate|up; SiLU-and-mul then cuBLAS for down)
  beside one skinny launch with that producer as its prologue, at the gemm section's
  best config for the shape, with the prefetch flipped, and at the default tiles
  (``default_config``: the model's launch); for the RMSNorm producer also with
  ``one_pass_norm`` at both.

- ``layer`` (first): one llama layer's GEMM path as the model runs it (its RMSNorm,
  Linear and SiLU-and-mul modules through ``norm_then_linear`` / ``silu_then_linear``;
  attention left out, o_proj reads a fixed buffer), 8 layers chained in one CUDA graph so
  their weights miss L2, with the decode-size GEMM on (default tiles, the prologues
  ``prologue_pays`` picks) and off (the fused norm kernels, cuBLAS, SiLU-and-mul), each
  launched as Llama launches them (no PDL) and with PDL (at one row also with 0 and 2 of
  the weight's K steps loaded before the PDL wait, and with the norms folded in one
  pass); per-layer ms against the copy rate for the weights, and each launch's device
  time from the profiler (with PDL a launch's span starts before its predecessor ends).

``--device cpu``: tiny shapes, kernels in Triton's interpreter, eager host-clock times (a
smoke run: tests/bench/test_bench_scripts.py).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _graph import capture_calls  # noqa: E402
from _interp import bench_device  # noqa: E402

GPU_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}  # fmt: skip
CPU_SHAPES = {"qkv": (48, 32), "o": (32, 32), "gate_up": (64, 32), "down": (32, 32)}
PRODUCER = {"qkv": "rmsnorm", "gate_up": "rmsnorm", "down": "silu_mul"}


def splits(n: int, block_n: int) -> tuple[int, ...]:
    """The split-K slice counts timed for ``n`` columns in ``block_n``-wide tiles: more
    than one only where the column tiles alone are fewer than ~2 per SM (132 on the H100)."""
    return (1, 2, 4) if -(-n // block_n) < 264 else (1,)


def sweep(quick: bool, rows: int, cpu: bool, n: int) -> list[Any]:
    """The configs timed for an ``n``-column projection at ``rows`` rows."""
    from pdserve.kernels.skinny_gemm import SkinnyConfig, block_rows, fit_stages

    if cpu:
        return [SkinnyConfig(block_n=16, block_k=16), SkinnyConfig(block_n=16, block_k=32),
                SkinnyConfig(block_n=16, block_k=16, split_k=2),
                SkinnyConfig(block_n=16, block_k=32, swap=True)] + (
            [SkinnyConfig(block_n=8, block_k=32, row_dot=False)] if rows == 1 else []
        )  # fmt: skip
    ns, ks = ((16, 32), (256, 512)) if quick else ((16, 32, 64), (128, 256, 512))
    warps, stages = ((4,), (3, 4)) if quick else ((4, 8), (3, 4))
    prefetch = (False,) if quick else (False, True)
    out = [SkinnyConfig(block_n=bn, block_k=k, num_warps=w, num_stages=s, prefetch=p,
                        split_k=sk)
           for bn, k, w, s, p in itertools.product(ns, ks, warps, stages, prefetch)
           for sk in splits(n, bn) if not (rows > 16 and bn > 32)]  # fmt: skip
    # the product transposed (the weight's columns as the MMA's M: Hopper's warpgroup MMA)
    out += [SkinnyConfig(block_n=bn, block_k=k, num_stages=s, split_k=sk, swap=True)
            for bn, k, s in itertools.product((64, 128), (128, 256), (3, 4))
            for sk in splits(n, bn)]  # fmt: skip
    # not those whose ring of tiles the kernel would cut to fewer stages (a repeat)
    out = [c for c in out if fit_stages(c, block_rows(c, rows), 2, 2) == c.num_stages]
    if rows == 1:  # the register path: one row, no MMA
        out += [SkinnyConfig(block_n=bn, block_k=k, num_warps=w, num_stages=s, row_dot=False)
                for bn, k, w, s in itertools.product((4, 8, 16), (512, 1024), (4,), (2, 3))]  # fmt: skip
    return out


def timer(dev: torch.device) -> Callable[[list[Callable[[], object]]], float]:
    """Per-call ms of ``calls``: a CUDA graph of them replayed (median of 10 replays);
    on a CPU the median eager call."""

    def time_calls(calls: list[Callable[[], object]]) -> float:
        if dev.type != "cuda":
            calls[0]()
            t = []
            for _ in range(3):
                t0 = time.perf_counter()
                calls[0]()
                t.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(t)
        graph = capture_calls(calls)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ms = []
        for _ in range(10):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end) / len(calls))
        return statistics.median(ms)

    return time_calls


def copy_rate(dev: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second (1 on a CPU)."""
    if dev.type != "cuda":
        return 1.0
    src = torch.empty(1 << 28, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    ms = timer(dev)([lambda: dst.copy_(src)] * 4)
    return 2 * src.numel() * 2 / (ms * 1e-3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="a smaller config sweep")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--fp8", action="store_true", help="also the FP8-weight section")
    ap.add_argument("--projs", default="qkv,o,gate_up,down",
                    help="the projections of the gemm, fused and fp8 sections, in this order")  # fmt: skip
    args = ap.parse_args(argv)
    dev = bench_device(args.device)
    if dev is None:
        return 1
    from pdserve.kernels.activation import silu_and_mul
    from pdserve.kernels.rmsnorm import fused_add_rmsnorm
    from pdserve.kernels.skinny_gemm import SkinnyConfig, default_config, skinny_gemm

    cpu = dev.type != "cuda"
    shapes = CPU_SHAPES if cpu else GPU_SHAPES
    dt = torch.float32 if cpu else torch.bfloat16
    time_calls = timer(dev)
    bw = copy_rate(dev)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if not cpu else "cpu",
                           "copy_tb_s": bw / 1e12, "gemm": [], "fused": [], "fp8": []}  # fmt: skip
    print(f"copy rate {bw / 1e12:.2f} TB/s")
    g = torch.Generator(device="cpu").manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    res["layer"] = layer_section(shapes, rows_list, dev, dt, bw, time_calls)
    Path(args.out).write_text(json.dumps(res, indent=1))
    for name in [p for p in args.projs.split(",") if p]:  # "": the layer section only
        n, k = shapes[name]
        copies = 1 if cpu else max(2, min(16, -(-200_000_000 // (n * k * 2))))
        ws = [(torch.randn(n, k, generator=g) * 0.02).to(dev, dt) for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=g).to(dev, dt)
            nbytes = (n * k + rows * k + rows * n) * x.element_size()
            cublas = time_calls([lambda w=w, x=x: F.linear(x, w) for w in ws])
            row: dict[str, Any] = {"proj": name, "n": n, "k": k, "rows": rows, "copies": copies,
                                   "bytes": nbytes, "cublas_ms": cublas, "configs": []}  # fmt: skip
            ref = F.linear(x.float(), ws[0].float())
            for cfg in sweep(args.quick, rows, cpu, n):
                try:
                    err = (skinny_gemm(x, ws[0], config=cfg).float() - ref).abs().max().item()
                    ms = time_calls(
                        [lambda w=w, c=cfg, x=x: skinny_gemm(x, w, config=c) for w in ws]
                    )
                except Exception as e:  # a config the compiler refuses (resources)
                    row["configs"].append({"config": vars(cfg), "error": repr(e)[:200]})
                    continue
                row["configs"].append({"config": vars(cfg), "ms": ms, "max_err": err})
            ok = [c for c in row["configs"] if "ms" in c]
            best = min(ok, key=lambda c: c["ms"])
            row["best"] = best
            dflt = [c for c in ok if c["config"] == vars(default_config(rows))]
            row["default_ms"] = dflt[0]["ms"] if dflt else None
            row["cublas_x_copy"] = cublas / (nbytes / bw * 1e3)
            row["skinny_x_copy"] = best["ms"] / (nbytes / bw * 1e3)
            res["gemm"].append(row)
            Path(args.out).write_text(json.dumps(res, indent=1))  # so far, should a timeout come
            print(f"{name:8s} {n:6d}x{k:<6d} rows {rows:3d}: cuBLAS {cublas * 1e3:7.1f} us "
                  f"({row['cublas_x_copy']:.2f}x copy), skinny {best['ms'] * 1e3:7.1f} us "
                  f"({row['skinny_x_copy']:.2f}x) {best['config']} err {best['max_err']:.3g}; "
                  f"default tiles {row['default_ms'] and row['default_ms'] * 1e3 or 0:.1f} us",
                  flush=True)  # fmt: skip
            if name not in PRODUCER:
                continue
            cfg = SkinnyConfig(**best["config"])
            res["fused"].append(fused_row(name, rows, k, x, ws, cfg, dt, dev, time_calls, g,
                                          fused_add_rmsnorm, silu_and_mul, skinny_gemm))  # fmt: skip
        if args.fp8:
            fp8_rows(name, n, k, ws, args.rows, dev, dt, bw, time_calls, g, res["fp8"], cpu)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def layer_section(shapes, rows_list, dev, dt, bw, time_calls):  # type: ignore[no-untyped-def]
    """The model's layer path with the decode-size GEMM on and off (see the module doc)."""
    from pdserve.layers.activation import SiluAndMul
    from pdserve.layers.linear import Linear, norm_then_linear, silu_then_linear
    from pdserve.layers.norm import RMSNorm

    cpu = dev.type != "cuda"
    hidden, inter = shapes["o"][0], shapes["down"][1]
    torch.manual_seed(0)

    def lin(n: int, k: int) -> Any:
        m = Linear(k, n, dtype=dt).to(dev)
        m.weight.data.normal_(0, 0.02)
        return m

    def norm() -> Any:
        m = RMSNorm(hidden, 1e-5, dt).to(dev)
        m.weight.data.uniform_(0.5, 1.5)
        m.fused = True  # the GPU default; the interpreter's kernel on a CPU
        return m

    layers = []
    for _ in range(1 if cpu else 8):
        act = SiluAndMul()
        act.fused = True
        layers.append({"n1": norm(), "qkv": lin(shapes["qkv"][0], hidden), "o": lin(hidden, hidden),
                       "n2": norm(), "gate_up": lin(2 * inter, hidden), "act": act,
                       "down": lin(hidden, inter)})  # fmt: skip
    wbytes = sum(m.weight.numel() * m.weight.element_size() for m in layers[0].values()
                 if isinstance(m, Linear))  # fmt: skip
    out = []
    for rows in rows_list:
        x = torch.randn(rows, hidden, device=dev).to(dt)
        attn = torch.randn(rows, hidden, device=dev).to(dt)  # attention's output, fixed

        def step(x: torch.Tensor = x, attn: torch.Tensor = attn) -> tuple[torch.Tensor, ...]:
            h, res, qkv = x, None, x
            for ly in layers:
                qkv, res = norm_then_linear(ly["n1"], ly["qkv"], h, res)
                h = ly["o"](attn)
                gu, res = norm_then_linear(ly["n2"], ly["gate_up"], h, res)
                h = silu_then_linear(ly["act"], ly["down"], gu)
            return qkv, h, res

        row: dict[str, Any] = {"rows": rows, "layers": len(layers), "weight_bytes": wbytes}
        ref: tuple[torch.Tensor, ...] = ()
        for mode, on, pdl, early, norm1p in layer_modes(rows, cpu):
            for ly in layers:
                for m in ly.values():
                    if isinstance(m, Linear):
                        m.skinny_rows = max(rows, 1) if on else 0
            with launch_setting(pdl, early, norm1p):
                got = step()  # the last layer's q|k|v, output and residual, against off's
                ref = ref or got
                diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref, strict=True))
                ms = time_calls([step]) / len(layers)
                launches = [] if cpu else launch_times(step, len(layers))
            row[f"{mode}_max_diff"] = diff
            row[f"{mode}_ms"] = ms
            row[f"{mode}_x_copy"] = ms / (wbytes / bw * 1e3)
            row[f"{mode}_launches"] = launches
            print(f"layer rows {rows:3d} {mode:>14}: {ms * 1e3:7.1f} us ({ms / (wbytes / bw * 1e3):.2f}x "
                  f"copy, max diff {diff:.3g}); " + ", ".join(f"{n[:28]} {us:.1f}" for n, us in launches), flush=True)  # fmt: skip
        out.append(row)
    return out


Mode = tuple[str, bool, bool, int | None, bool]


def layer_modes(rows: int, cpu: bool) -> list[Mode]:
    """The layer section's modes: (name, decode-size GEMM on, PDL, the one-row tiles'
    ``early_w`` (None: the default's), the norms folded in one pass). ``off`` and
    ``skinny`` launch as the Llama model did before its defaults (no PDL); the rest with
    PDL, at one row also with 0 and 2 early weight steps and with the norms folded into
    q|k|v and gate|up in one pass (``one_pass_norm``)."""
    modes: list[Mode] = [("off", False, False, None, False), ("skinny", True, False, None, False)]
    if cpu:
        return modes + [("skinny_norm1p", True, False, None, True)] if rows == 1 else modes
    modes += [("off_pdl", False, True, None, False), ("skinny_pdl", True, True, None, False)]
    if rows == 1:
        modes += [(f"skinny_pdl_early{e}", True, True, e, False) for e in (0, 2)]
        modes.append(("skinny_pdl_norm1p", True, True, None, True))
    return modes


@contextlib.contextmanager
def launch_setting(pdl: bool, early: int | None, norm1p: bool = False) -> Iterator[None]:
    """PDL on or off where ``PDSERVE_PDL`` is unset, the one-row tiles' ``early_w``, and
    (``norm1p``) add+RMSNorm folded into the one-row launches in one pass, for the
    launches (and captures) inside; all restored after."""
    from pdserve.kernels import _utils
    from pdserve.kernels import skinny_gemm as sk

    was_pdl, was_cfg, was_pays = _utils._pdl_default[0], sk.ONE_ROW, sk.prologue_pays
    _utils.use_pdl_by_default(pdl)
    if early is not None:
        sk.ONE_ROW = replace(sk.ONE_ROW, early_w=early)
    if norm1p:
        sk.ONE_ROW = replace(sk.ONE_ROW, one_pass_norm=True)
        sk.prologue_pays = lambda rows, prologue: rows == 1 or was_pays(rows, prologue)
    try:
        yield
    finally:
        _utils.use_pdl_by_default(was_pdl)
        sk.ONE_ROW, sk.prologue_pays = was_cfg, was_pays


def launch_times(step: Callable[[], object], n_layers: int) -> list[tuple[str, float]]:
    """Each launch of one layer: (kernel name, device us averaged over the layers), from
    the profiler over a CUDA graph of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    from pdserve.profiling.step_profile import spans_from_events

    graph = capture_calls([step])
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    spans = spans_from_events(prof.events(), "cuda")
    per = len(spans) // n_layers
    return [(spans[i].name, sum(spans[i + j * per].end_us - spans[i + j * per].start_us
                                for j in range(n_layers)) / n_layers)
            for i in range(per)]  # fmt: skip


def fp8_rows(name, n, k, ws, rows_arg, dev, dt, bw, time_calls, g, out, cpu):  # type: ignore[no-untyped-def]
    """The block-FP8 GEMM beside the skinny kernel over the same FP8 weights."""
    from pdserve.kernels.fp8_gemm import block_fp8_gemm
    from pdserve.kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks
    from pdserve.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

    qs = [quantize_fp8_blocks(w, (128, 128)) for w in ws]
    # K steps of one scale block (128) and wider (each activation column scaled by its
    # block's scale: wide_fp8_steps)
    configs = [SkinnyConfig(block_n=16, block_k=128), SkinnyConfig(block_n=16, block_k=256)] \
        if cpu else [
        SkinnyConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=st, split_k=sk)
        for bn, w, st in itertools.product((16, 32, 64), (4,), (3, 4, 6))
        for bk in (128, 256, 512) for sk in splits(n, bn) if bk == 128 or st < 6
    ] + [SkinnyConfig(block_n=bn, block_k=128, num_stages=st, split_k=sk, swap=True)
         for bn, st in itertools.product((64, 128), (3, 4, 6)) for sk in splits(n, bn)]  # fmt: skip
    # one row also on the register path (narrower tiles, weight steps early)
    one_row = [SkinnyConfig(block_n=8, block_k=512, row_dot=False, early_w=2)] if cpu else [
        SkinnyConfig(block_n=bn, block_k=bk, row_dot=False, early_w=e)
        for bn in (8, 16, 32) for bk in (128, 512) for e in (0, 1, 2)
    ]  # fmt: skip
    for rows in (int(r) for r in rows_arg.split(",")):
        x = torch.randn(rows, k, generator=g).to(dev, dt)
        nbytes = (
            n * k + (-(-n // 128)) * (-(-k // 128)) * 4 + (rows * k + rows * n) * x.element_size()
        )
        ref = torch.nn.functional.linear(x.float(), dequantize_fp8_blocks(*qs[0], (128, 128)))
        triton_ms = time_calls([lambda q=q, x=x: block_fp8_gemm(x, q[0], q[1]) for q in qs])
        best: dict[str, Any] = {}
        worst = 0.0  # the largest error of any config
        default_ms = time_calls([lambda q=q, x=x: skinny_gemm(x, q[0], weight_scale=q[1])
                                 for q in qs])  # fmt: skip
        for cfg in configs + (one_row if rows == 1 else []):
            kw = {"config": cfg, "scale_rows": 128}
            err = (skinny_gemm(x, qs[0][0], weight_scale=qs[0][1], **kw).float() - ref).abs().max()
            worst = max(worst, err.item())
            ms = time_calls([lambda q=q, x=x, kw=kw: skinny_gemm(x, q[0], weight_scale=q[1], **kw)
                             for q in qs])  # fmt: skip
            if not best or ms < best["ms"]:
                best = {"ms": ms, "config": vars(cfg), "max_err": err.item()}
        bound = nbytes / bw * 1e3
        out.append({"proj": name, "rows": rows, "bytes": nbytes, "triton_ms": triton_ms,
                    "triton_x_copy": triton_ms / bound, "skinny": best,
                    "skinny_x_copy": best["ms"] / bound, "default_config_ms": default_ms,
                    "worst_err": worst})  # fmt: skip
        print(f"fp8 {name:8s} rows {rows:3d}: Triton block-FP8 {triton_ms * 1e3:7.1f} us "
              f"({triton_ms / bound:.2f}x copy), skinny {best['ms'] * 1e3:7.1f} us "
              f"({best['ms'] / bound:.2f}x) {best['config']}; default tiles "
              f"{default_ms * 1e3:.1f} us", flush=True)  # fmt: skip


def fused_row(name, rows, k, x, ws, cfg, dt, dev, time_calls, g, add_norm, silu_mul, skinny):  # type: ignore[no-untyped-def]
    """Today's two launches (producer, then cuBLAS) beside one skinny launch with the
    producer as its prologue; the outputs compared."""
    from pdserve.kernels.skinny_gemm import default_config

    if PRODUCER[name] == "rmsnorm":
        res_in = torch.randn(rows, k, generator=g).to(dev, dt)
        nw = (torch.rand(k, generator=g) + 0.5).to(dev, dt)

        def today(w: torch.Tensor) -> torch.Tensor:
            h, _ = add_norm(x, res_in, nw, 1e-5)
            return F.linear(h, w)

        def fused(w: torch.Tensor, c: Any = cfg) -> torch.Tensor:
            return skinny(x, w, prologue="rmsnorm", residual=res_in, norm_weight=nw, eps=1e-5,
                          config=c)[0]  # fmt: skip
    else:
        gu = torch.randn(rows, 2 * k, generator=g).to(dev, dt)

        def today(w: torch.Tensor) -> torch.Tensor:
            return F.linear(silu_mul(gu), w)

        def fused(w: torch.Tensor, c: Any = cfg) -> torch.Tensor:
            return skinny(gu, w, prologue="silu_mul", config=c)  # type: ignore[no-any-return]

    err = (fused(ws[0]).float() - today(ws[0]).float()).abs().max().item()
    t_ms = time_calls([lambda w=w: today(w) for w in ws])
    f_ms = time_calls([lambda w=w: fused(w) for w in ws])
    # the same launch with the activation prefetch flipped: what the prologue's loads cost
    flip = replace(cfg, prefetch=not cfg.prefetch)
    flip_ms = time_calls([lambda w=w: fused(w, flip) for w in ws])
    # and at default_config's tiles: the launch the model makes
    d_ms = time_calls([lambda w=w: fused(w, default_config(rows)) for w in ws])
    # the norm in one pass (no pass for the statistics first), at both tiles
    one: dict[str, float] = {}
    if PRODUCER[name] == "rmsnorm":
        for tag, c in (("best", replace(cfg, split_k=1)), ("default", default_config(rows))):
            c1 = replace(c, one_pass_norm=True)
            one[tag] = time_calls([lambda w=w, c1=c1: fused(w, c1) for w in ws])
        one["max_diff"] = (fused(ws[0], c1).float() - today(ws[0]).float()).abs().max().item()
    print(f"  {PRODUCER[name]} + {name} rows {rows}: today {t_ms * 1e3:7.1f} us, "
          f"one launch {f_ms * 1e3:7.1f} us (prefetch {cfg.prefetch}; flipped "
          f"{flip_ms * 1e3:7.1f} us; default tiles {d_ms * 1e3:7.1f} us), max diff {err:.3g}"
          + (f"; one-pass norm {one['best'] * 1e3:7.1f} us (default tiles "
             f"{one['default'] * 1e3:7.1f} us, max diff {one['max_diff']:.3g})" if one else ""),
          flush=True)  # fmt: skip
    return {"proj": name, "rows": rows, "producer": PRODUCER[name], "today_ms": t_ms,
            "fused_ms": f_ms, "prefetch_flipped_ms": flip_ms, "default_config_ms": d_ms,
            "one_pass_norm": one, "max_diff": err, "config": vars(cfg)}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
