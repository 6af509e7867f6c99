"""Tile-configuration sweep of the block-FP8 GEMM (``pdserve.kernels.fp8_gemm.block_fp8_gemm``).

    source scripts/gpu-env
    python3 benchmarks/fp8_gemm_sweep.py --out $OUT/fp8_gemm_sweep.json

Times the Triton kernel under many launch configurations (:class:`Fp8GemmConfig`) for
M (tokens) in 1, 16, 64, 256, 8192 and the llama-8b projections (N, K): ``down``
4096 x 14336, ``gate_up`` 28672 x 4096, ``qkv`` 6144 x 4096. It changes no default: the
data decides. About 60 s on an H200; a time budget (``--budget-s``, 75 s counted after
importing torch) skips whatever is left past it and counts it as skipped in the table, so
the run ends before 90 s. ``--quick`` is a smaller grid; ``--shapes`` / ``--tokens`` narrow
it.

Variants (fields of ``Fp8GemmConfig``; see the kernel module's docstring):
  base         today's numerics: activations quantized per token per 128 channels in the
               kernel, fp8 x fp8 MMA; K splits (split-K) write float32 partials that one
               ``sum`` adds up. Deterministic.
  +wo          weight_only: no activation quantization, bf16 x times the fp8 weight tile
               upcast to bf16 (``x @ (w_fp8 * scale)^T``). Other numerics (no activation
               quantization error; closer to bf16), more ALU work per weight byte.
  +at          atomic_splits: the K splits add their float32 partials into one zeroed
               output with atomics (no partial buffer, no separate sum kernel). Not
               bitwise deterministic (last float32 bits vary run to run).
  g<N>         group_m: grouped (L2-swizzled) tile order, for large M only.

Grid (each point is one resolved config; ``k`` below is the number of K splits):
  M <= 64     block_m as the heuristic (16/32/64), block_n 32/64/128/256, warps 4/8,
              stages 2/3/4/5, the heuristic's splits for that tile; then, for the best 3
              of those per shape and M: splits 0.5x/1x/2x of the heuristic's x the
              variants base, +wo, +at, +wo+at
  M 256       block_m 64/128, block_n 128/256, warps 4/8, stages 2-5, heuristic splits;
              then for the best 3: splits 1/1x/2x, with and without +at
  M >= 1024   block_m 64/128, block_n 128/256, warps 4/8, stages 2-5, no split, group_m
              8; then for the best 3: group_m 1/4/16
plus today's default (``config=None``) for every shape and M. Configs that fail to
compile or need more shared memory than the GPU has are kept with their error string.
Every output is checked against a reference (the default config's output; bf16 matmul
of the dequantized weights for +wo): ``rel_err`` (max |diff| / max |ref|) above 2e-2
marks the point bad and it cannot be "best".

Timing: each measurement is one CUDA graph holding the call many times over (launch
overhead excluded, as in a captured decode step), the median of a few replays divided by
the number of calls. The calls cycle through copies of the weights that together exceed
3x the L2 cache, so every call reads its weights from HBM as a layer of a real model
does. Kernels are compiled first in parallel worker processes (``--jobs``) that fill
Triton's disk cache with the same specializations (a small proxy problem), so the timed
process only loads them.

References, per shape and M:
  roof     the fp8 roofline: max(bytes / copy bandwidth, 2*M*N*K / fp8 matmul peak), bytes
           = fp8 weights + their scales + bf16 activations in and out; the copy bandwidth
           is one 1 GiB device-to-device copy (bytes read + written) and the fp8 peak
           torch._scaled_mm on 8192^3 with per-tensor scales, both measured in this run
  bf16     torch.matmul of bf16 x and bf16 weights (cuBLAS; the fp8 weights dequantized,
           so the same values), timed the same way
  smm      M >= 256 only: torch._scaled_mm with 1x128 / 128x128 block scales
           (scaled_mm_block_fp8, activation quantization included), which
           pdserve.layers.fp8 uses from 256 tokens on outside CUDA graphs where this
           PyTorch supports it; "-" where it is not supported (the error is in the JSON)

Table, one line per shape and M (all times in ms per call):
  roof, bf16, smm      the references above
  default (xR)         today's heuristic config and its ratio to the roofline (the
                       decode target is xR <= 1.3)
  best (xR) bf16/best  the fastest good point of any variant, its roofline ratio, and
                       bf16's time over it (> 1: fp8 faster than bf16)
  config               the best point: m<block_m> n<block_n> w<warps> s<stages>
                       k<splits> [g<group_m>] [+wo] [+at]
  det                  the fastest deterministic point with today's numerics (base,
                       any tile order), when the best one is a +wo or +at variant
``--out`` gets every point (config asked and resolved, ms, x roofline, rel_err, error,
first-call seconds), the references, the measured limits, the compile log and the
summary. A first call well under 0.1 s means the worker's compile was reused; 0.5 s or
more means the timed process compiled it itself (then ``meta.compile`` says why).

``--device cpu`` is a smoke mode for tests: a tiny shape under Triton's interpreter
(TRITON_INTERPRET=1), 2 tile configs and the 3 variants, wall-clock timing; its numbers
mean nothing, it runs the code path.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

_T0 = time.perf_counter()  # the budget counts from here (after importing torch)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _interp import interpreter_fix  # noqa: E402

if TYPE_CHECKING:
    from pdserve.kernels.fp8_gemm import Fp8GemmConfig

SHAPES: dict[str, tuple[int, int]] = {
    "down": (4096, 14336),
    "gate_up": (28672, 4096),
    "qkv": (6144, 4096),
}
TOKENS = (1, 16, 64, 256, 8192)
CPU_SHAPES: dict[str, tuple[int, int]] = {"tiny": (64, 256)}
CPU_TOKENS = (1, 20)
SMALL_M = 64  # up to here: split-K decode shapes
LARGE_M = 1024  # from here: prefill shapes, no split, grouped order
TOL = 2e-2  # max |out - ref| / max |ref| for a point to count
TOP = 3  # tile configs per shape and M that phase 2 refines
SCALED_MM_MIN = 256  # pdserve.layers.fp8.SCALED_MM_MIN_TOKENS
PROXY_N, PROXY_K = 256, 2048  # the compile workers' problem: same specializations


def _kernels() -> Any:
    """The kernel module, imported late: ``--device cpu`` must set TRITON_INTERPRET first."""
    from pdserve.kernels import fp8_gemm

    return fp8_gemm


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:300]}"


def heuristic_block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


# ------------------------------------------------------------------------------ points
@dataclass
class Point:
    shape: str
    n: int
    k: int
    m: int
    phase: str  # default | tile | refine
    config: Fp8GemmConfig | None  # as asked (None: the default heuristic)
    resolved: Fp8GemmConfig
    ms: float | None = None
    x_roofline: float | None = None
    rel_err: float | None = None
    first_call_s: float | None = None
    error: str | None = None
    skipped: str | None = None

    @property
    def ok(self) -> bool:
        return self.ms is not None and (self.rel_err is None or self.rel_err < TOL)

    @property
    def deterministic_base(self) -> bool:
        r = self.resolved
        return not r.weight_only and not (r.atomic_splits and (r.num_splits or 1) > 1)


def label(cfg: Fp8GemmConfig) -> str:
    s = f"m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} k{cfg.num_splits}"
    if cfg.group_m and cfg.group_m > 1:
        s += f" g{cfg.group_m}"
    if cfg.weight_only:
        s += " +wo"
    if cfg.atomic_splits and (cfg.num_splits or 1) > 1:
        s += " +at"
    return s


def compile_key(cfg: Fp8GemmConfig) -> tuple:
    """What selects a compiled kernel: constexprs, warps, stages and the output dtype
    (bf16 without a split, float32 partials with); not M, N, K nor the split count."""
    split = (cfg.num_splits or 1) > 1
    return (
        cfg.block_m,
        cfg.block_n,
        cfg.num_warps,
        cfg.num_stages,
        cfg.group_m,
        cfg.weight_only,
        cfg.atomic_splits and split,
        split,
    )


def tile_grid(m: int, quick: bool, cpu: bool) -> list[Fp8GemmConfig]:
    """Phase 1: tile shapes, warps and stages for ``m`` rows (the heuristic's splits)."""
    cfg_cls = _kernels().Fp8GemmConfig
    if cpu:
        return [cfg_cls(block_n=32, num_warps=8, num_stages=2)]
    warps: tuple[int, ...] = (4, 8)
    stages: tuple[int, ...] = (3, 4) if quick else (2, 3, 4, 5)
    group, splits = 1, None
    if m <= SMALL_M:
        bms: tuple[int, ...] = (heuristic_block_m(m),)
        bns: tuple[int, ...] = (64, 128, 256) if quick else (32, 64, 128, 256)
    elif m < LARGE_M:
        bms, bns = (64, 128), (128, 256)
    else:
        bms, bns, group, splits = (64, 128), (128, 256), 8, 1
        warps = (8,) if quick else warps
    return [
        cfg_cls(
            block_m=bm,
            block_n=bn,
            num_warps=w,
            num_stages=s,
            num_splits=splits,
            group_m=group,
        )
        for bm in bms
        for bn in bns
        for w in warps
        for s in stages
    ]


def refinements(base: Fp8GemmConfig, m: int, k: int, cpu: bool) -> list[Fp8GemmConfig]:
    """Phase 2 around one good resolved tile config: split counts and variants."""
    kb = -(-k // 128)
    if cpu:
        return [
            replace(base, weight_only=True),
            replace(base, atomic_splits=True),
            replace(base, weight_only=True, atomic_splits=True),
        ]
    h = base.num_splits or 1
    out = []
    if m <= SMALL_M:
        for s in sorted({max(1, h // 2), h, min(kb, 2 * h)}):
            for wo in (False, True):
                for at in (False, True):
                    if not (at and s == 1):
                        out.append(replace(base, num_splits=s, weight_only=wo, atomic_splits=at))
    elif m < LARGE_M:
        for s in sorted({1, h, min(kb, 2 * h)}):
            for at in (False, True):
                if not (at and s == 1):
                    out.append(replace(base, num_splits=s, atomic_splits=at))
    else:
        out = [replace(base, group_m=g) for g in (1, 4, 16)]
    return out


def plan_tiles(
    shapes: dict[str, tuple[int, int]], tokens: Iterable[int], quick: bool, cpu: bool, sms: int
) -> list[Point]:
    """Phase 1 points: today's default, then the tile grid, per shape and M (configs that
    resolve to one already planned are left out)."""
    resolve = _kernels().resolve_fp8_gemm_config
    points: list[Point] = []
    for name, (n, k) in shapes.items():
        for m in tokens:
            seen = set()
            for phase, cfg in [("default", None)] + [("tile", c) for c in tile_grid(m, quick, cpu)]:
                r = resolve(m, n, k, sms, cfg)
                if r not in seen:
                    seen.add(r)
                    points.append(Point(name, n, k, m, phase, cfg, r))
    return points


def plan_refinements(points: list[Point], cpu: bool, sms: int, top: int) -> list[Point]:
    """Phase 2 points: :func:`refinements` of the ``top`` fastest good points of each
    shape and M."""
    resolve = _kernels().resolve_fp8_gemm_config
    groups: dict[tuple[str, int], list[Point]] = {}
    for p in points:
        groups.setdefault((p.shape, p.m), []).append(p)
    out: list[Point] = []
    for group in groups.values():
        seen = {p.resolved for p in group}
        best = sorted((p for p in group if p.ok), key=lambda p: p.ms or 0.0)[:top]
        for b in best:
            for cfg in refinements(b.resolved, b.m, b.k, cpu):
                r = resolve(b.m, b.n, b.k, sms, cfg)
                if r not in seen:
                    seen.add(r)
                    out.append(Point(b.shape, b.n, b.k, b.m, "refine", cfg, r))
    return out


# ------------------------------------------------------------------- parallel compiles
_PROXY: dict[str, torch.Tensor] = {}


def _warm_one(cfg: dict[str, Any]) -> tuple[float, str | None]:
    """In a worker process: run ``cfg`` once on a small problem with the specializations
    of the real ones (every size and stride a multiple of 16), which compiles it into
    Triton's disk cache."""
    t = time.perf_counter()
    try:
        fp8 = _kernels()
        if not _PROXY:
            dev = torch.device("cuda")
            _PROXY["x"] = torch.randn(16, PROXY_K, device=dev, dtype=torch.bfloat16)
            _PROXY["w"] = torch.randn(PROXY_N, PROXY_K, device=dev).to(torch.float8_e4m3fn)
            _PROXY["ws"] = torch.ones(PROXY_N // 128, PROXY_K // 128, device=dev)
        fp8.block_fp8_gemm(_PROXY["x"], _PROXY["w"], _PROXY["ws"], config=fp8.Fp8GemmConfig(**cfg))
        torch.cuda.synchronize()
        error = None
    except Exception as e:  # out of shared memory, compile failures: the main run records them
        error = _err(e)
    return time.perf_counter() - t, error


class Compiler:
    """Compiles the kernels of planned points ahead of timing, ``jobs`` processes wide."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.pool: ProcessPoolExecutor | None = None
        self.done: set[tuple] = set()
        self.log: list[dict[str, Any]] = []

    def warm(self, points: list[Point], deadline: float) -> None:
        todo: dict[tuple, dict[str, Any]] = {}
        for p in points:
            key = compile_key(p.resolved)
            if key not in self.done and key not in todo:
                splits = p.resolved.num_splits or 1
                proxy = replace(p.resolved, num_splits=min(splits, PROXY_K // 128))
                todo[key] = asdict(proxy)
        self.done.update(todo)
        if self.jobs <= 0 or not todo:
            return
        t = time.perf_counter()
        entry: dict[str, Any] = {"kernels": len(todo), "jobs": self.jobs}
        try:
            if self.pool is None:
                ctx = multiprocessing.get_context("spawn")
                self.pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=ctx)
            futures: list[Future] = [self.pool.submit(_warm_one, cfg) for cfg in todo.values()]
            finished, late = wait(futures, timeout=max(1.0, deadline - time.perf_counter()))
            for f in late:
                f.cancel()
            results = [f.result() if f.exception() is None else (0.0, "crashed") for f in finished]
            errors = [e for _, e in results if e]
            entry.update(
                finished=len(finished),
                failed=len(errors),  # out of shared memory, mostly; timed runs record them
                first_error=errors[0] if errors else None,
                compile_s_sum=sum(s for s, _ in results),
            )
        except Exception as e:  # no pool here: the timed process compiles as it goes
            entry["error"] = _err(e)
        entry["wall_s"] = time.perf_counter() - t
        self.log.append(entry)
        print(f"compiled {json.dumps(entry)}", flush=True)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


# ---------------------------------------------------------------------------- timing
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


class Bench:
    def __init__(self, device: torch.device, budget_end: float) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.end = budget_end
        self.weights: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.weights_bf16: dict[str, list[torch.Tensor]] = {}
        self.x: dict[tuple[str, int], torch.Tensor] = {}
        self.refs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self.references: dict[tuple[str, int], dict[str, Any]] = {}
        self.limits: dict[str, Any] = {}

    # -- device facts
    def measure_limits(self) -> dict[str, Any]:
        dev = self.device
        n = (1 << 29) if self.cuda else (1 << 23)  # bf16 elements: 1 GiB on the GPU
        src = torch.randn(n, dtype=torch.bfloat16, device=dev)
        dst = torch.empty_like(src)
        ms = self._eager_ms(lambda: dst.copy_(src), 10)
        lim: dict[str, Any] = {"copy_bandwidth_Bps": 2 * n * 2 / (ms / 1e3)}
        lim["fp8_matmul_flops"] = None
        if self.cuda:
            try:
                from gpu_suite import fp8_matmul_flops

                lim["fp8_matmul_flops"] = fp8_matmul_flops(str(dev))
            except Exception as e:
                lim["fp8_matmul_error"] = _err(e)
            props = torch.cuda.get_device_properties(dev)
            lim["l2_bytes"] = int(getattr(props, "L2_cache_size", 0)) or 50 << 20
            lim["sms"] = props.multi_processor_count
            torch.cuda.empty_cache()
        else:
            lim["l2_bytes"] = 0
        self.limits = lim
        return lim

    def _eager_ms(self, fn: Callable[[], object], reps: int) -> float:
        fn()
        if not self.cuda:
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t) * 1e3 / reps
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)

    def time_ms(self, call: Callable[[int], object], copies: int) -> float:
        """Milliseconds per ``call(i)`` (``i`` picks the weight copy): CUDA-graph replay of
        many calls; on the CPU one call's wall time."""
        if not self.cuda:
            t = time.perf_counter()
            call(0)
            return (time.perf_counter() - t) * 1e3
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        call(0)
        e.record()
        e.synchronize()
        est = max(s.elapsed_time(e), 1e-3)  # eager: an upper bound
        calls = max(copies, min(64, math.ceil(2.0 / est)))
        calls = -(-calls // copies) * copies
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call(0)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                call(i % copies)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5 if est * calls < 20 else 3):
            s.record()
            graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / calls)
        del graph
        return statistics.median(times)

    # -- inputs and references
    def prepare_shape(self, name: str, n: int, k: int) -> None:
        from pdserve.kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks

        if name in self.weights:
            return
        gen = torch.Generator(device=self.device).manual_seed(n + k)
        w = torch.randn(n, k, device=self.device, generator=gen) * 0.02
        wq, ws = quantize_fp8_blocks(w, (128, 128))
        del w
        w16 = dequantize_fp8_blocks(wq, ws, (128, 128), dtype=torch.bfloat16)
        l2 = self.limits.get("l2_bytes", 0)
        copies8 = max(2, math.ceil(3 * l2 / wq.numel())) if self.cuda else 1
        copies16 = max(2, math.ceil(3 * l2 / (2 * wq.numel()))) if self.cuda else 1
        self.weights[name] = [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies8 - 1)]
        self.weights_bf16[name] = [w16] + [w16.clone() for _ in range(copies16 - 1)]

    def prepare_group(self, name: str, n: int, k: int, m: int) -> dict[str, Any]:
        """Activations, the bf16 reference (timed; its output checks +wo) and the roofline."""
        key = (name, m)
        if key in self.references:
            return self.references[key]
        print(f"{name} M={m}: {time.perf_counter() - _T0:.0f} s", flush=True)
        if self.cuda:
            torch.cuda.empty_cache()  # the last group's graph pools
        self.prepare_shape(name, n, k)
        gen = torch.Generator(device=self.device).manual_seed(m)
        x = torch.randn(m, k, device=self.device, generator=gen).to(torch.bfloat16)
        self.x[key] = x
        w16 = self.weights_bf16[name]
        self.refs[key] = {"w": x @ w16[0].t()}
        ref: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m}
        try:
            ref["bf16_ms"] = self.time_ms(lambda i: x @ w16[i].t(), len(w16))
        except Exception as e:
            ref["bf16_error"] = _err(e)
        if self.cuda and m >= SCALED_MM_MIN:  # what pdserve.layers.fp8 uses there, if it can
            smm, wl = _kernels().scaled_mm_block_fp8, self.weights[name]
            try:
                ref["scaled_mm_ms"] = self.time_ms(
                    lambda i: smm(x, wl[i][0], wl[i][1], torch.bfloat16), len(wl)
                )
            except Exception as e:
                ref["scaled_mm_error"] = _err(e)
        nbytes = n * k + (-(-n // 128)) * (-(-k // 128)) * 4 + 2 * m * k + 2 * m * n
        ref["bytes"] = nbytes
        ref["memory_roofline_ms"] = nbytes / self.limits["copy_bandwidth_Bps"] * 1e3
        peak = self.limits.get("fp8_matmul_flops")
        ref["compute_roofline_ms"] = 2 * m * n * k / peak * 1e3 if peak else None
        ref["roofline_ms"] = max(ref["memory_roofline_ms"], ref["compute_roofline_ms"] or 0.0)
        ref["weight_copies"] = len(self.weights[name])
        self.references[key] = ref
        return ref

    def run(self, p: Point) -> None:
        fp8 = _kernels()
        if time.perf_counter() > self.end:
            p.skipped = "time budget"
            return
        ref = self.prepare_group(p.shape, p.n, p.k, p.m)
        key = (p.shape, p.m)
        x, copies = self.x[key], self.weights[p.shape]

        def call(i: int) -> torch.Tensor:
            wq, ws = copies[i]
            return fp8.block_fp8_gemm(x, wq, ws, config=p.config)

        try:
            t = time.perf_counter()
            y = call(0)
            if self.cuda:
                torch.cuda.synchronize()
            p.first_call_s = time.perf_counter() - t
            refs = self.refs[key]
            if p.phase == "default":
                refs["q"] = y
                ref["default_vs_bf16_rel_err"] = rel_err(y, refs["w"])
            want = refs["w"] if p.resolved.weight_only else refs.get("q")
            p.rel_err = rel_err(y, want) if want is not None else None
            del y
            p.ms = p.first_call_s * 1e3 if not self.cuda else self.time_ms(call, len(copies))
            p.x_roofline = p.ms / ref["roofline_ms"]
        except Exception as e:
            p.error = _err(e)
            if self.cuda:
                try:
                    torch.cuda.synchronize()
                except Exception as e2:
                    p.error += f" | then: {_err(e2)}"


# --------------------------------------------------------------------------- report
def summarize(points: list[Point], references: dict[tuple[str, int], dict[str, Any]]) -> list:
    rows = []
    for key, ref in references.items():
        group = [p for p in points if (p.shape, p.m) == key]
        good = sorted((p for p in group if p.ok), key=lambda p: p.ms or 0.0)
        default = next((p for p in group if p.phase == "default"), None)
        det = [p for p in good if p.deterministic_base]
        row: dict[str, Any] = {
            "shape": ref["shape"],
            "m": ref["m"],
            "roofline_ms": ref["roofline_ms"],
            "bf16_ms": ref.get("bf16_ms"),
            "scaled_mm_ms": ref.get("scaled_mm_ms"),
            "default_ms": default.ms if default else None,
            "default_config": asdict(default.resolved) if default else None,
            "points": len(group),
            "failed": sum(1 for p in group if p.error),
            "bad": sum(1 for p in group if p.ms is not None and not p.ok),
            "skipped": sum(1 for p in group if p.skipped),
        }
        for tag, best in (("best", good[0] if good else None), ("det", det[0] if det else None)):
            row[f"{tag}_ms"] = best.ms if best else None
            row[f"{tag}_config"] = asdict(best.resolved) if best else None
            row[f"{tag}_label"] = label(best.resolved) if best else None
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    lim = meta["limits"]
    peak = lim.get("fp8_matmul_flops")
    print(
        f"\n== {meta['gpu']} | torch {meta['torch']} | triton {meta['triton']}"
        f" | copy {lim['copy_bandwidth_Bps'] / 1e12:.2f} TB/s"
        + (f" | fp8 matmul {peak / 1e12:.0f} TFLOP/s" if peak else "")
    )

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}" if v < 100 else f"{v:.0f}"

    print(
        f"{'shape':<8}{'M':>6}{'roof':>9}{'bf16':>9}{'smm':>9}{'default':>9}{'(xR)':>7}"
        f"{'best':>9}{'(xR)':>7}{'bf16/best':>10}  config"
    )
    for r in rows:
        roof = r["roofline_ms"]
        d, b, bf, smm = r["default_ms"], r["best_ms"], r["bf16_ms"], r["scaled_mm_ms"]
        print(
            f"{r['shape']:<8}{r['m']:>6}{f(roof):>9}{f(bf):>9}{f(smm):>9}{f(d):>9}"
            f"{x(d / roof if d else None):>7}{f(b):>9}{x(b / roof if b else None):>7}"
            f"{x(bf / b if bf and b else None):>10}  {r['best_label'] or '-'}"
            + (f"  [{r['failed']} failed]" if r["failed"] else "")
            + (f"  [{r['bad']} BAD]" if r["bad"] else "")
            + (f"  [{r['skipped']} skipped]" if r["skipped"] else "")
        )
        if r["det_label"] and r["det_label"] != r["best_label"]:
            dm = r["det_ms"]
            print(f"{'':<14}det {f(dm)} (x{x(dm / roof)})  {r['det_label']}")


# ----------------------------------------------------------------------------- main
def parse_shapes(text: str | None, cpu: bool) -> dict[str, tuple[int, int]]:
    table = CPU_SHAPES if cpu else SHAPES
    if not text:
        return dict(table)
    out = {}
    for item in text.split(","):
        if item in SHAPES or item in CPU_SHAPES:
            out[item] = {**SHAPES, **CPU_SHAPES}[item]
        else:
            n, k = (int(v) for v in item.lower().split("x"))
            out[item] = (n, k)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for every point")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="a smaller grid")
    ap.add_argument("--shapes", help="comma list: down,gate_up,qkv or NxK (default: all)")
    ap.add_argument("--tokens", help="comma list of M (default: 1,16,64,256,8192)")
    ap.add_argument("--top", type=int, default=TOP, help="tile configs refined per shape/M")
    ap.add_argument(
        "--jobs",
        type=int,
        default=min(12, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 4),
        help="compile worker processes (0: compile in the timed process)",
    )
    ap.add_argument(
        "--budget-s", type=float, default=75.0, help="seconds after import; later points skipped"
    )
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if "pdserve.kernels.fp8_gemm" not in sys.modules:
            interpreter_fix()
    elif not torch.cuda.is_available():
        print("no CUDA device; use --device cpu for the smoke mode", file=sys.stderr)
        return 2
    import triton

    from pdserve.kernels._utils import num_sms

    device = torch.device(args.device)
    shapes = parse_shapes(args.shapes, cpu)
    tokens = (
        tuple(int(t) for t in args.tokens.split(","))
        if args.tokens
        else (CPU_TOKENS if cpu else TOKENS)
    )
    deadline = _T0 + args.budget_s
    sms = num_sms(device)
    bench = Bench(device, deadline)
    compiler = Compiler(0 if cpu else args.jobs)
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(device) if not cpu else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "args": vars(args),
        "sms": sms,
    }

    def dump(points: list[Point], summary: list | None = None) -> None:
        meta["seconds"] = time.perf_counter() - _T0
        meta["compile"] = compiler.log
        res = {
            "meta": meta,
            "references": list(bench.references.values()),
            "summary": summary,
            "points": [asdict(p) | {"ok": p.ok} for p in points],
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))

    try:
        points = plan_tiles(shapes, tokens, args.quick, cpu, sms)
        compiler.warm(points, deadline - 25)  # leave time to measure
        meta["limits"] = bench.measure_limits()
        print(json.dumps(meta["limits"]), flush=True)
        for p in points:
            bench.run(p)
        dump(points)
        print(f"phase 1: {len(points)} points, {time.perf_counter() - _T0:.0f} s", flush=True)
        refine = plan_refinements(points, cpu, sms, args.top)
        compiler.warm(refine, deadline - 12)
        for p in refine:
            bench.run(p)
        points += refine
        print(f"phase 2: {len(refine)} points, {time.perf_counter() - _T0:.0f} s", flush=True)
    finally:
        compiler.close()
    summary = summarize(points, bench.references)
    dump(points, summary)
    print_table(summary, meta)
    print(f"\n{meta['seconds']:.0f} s; {len(points)} points; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
