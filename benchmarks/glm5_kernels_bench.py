"""GPU micro-benchmarks of the GLM-5 family's Triton kernels (issue 15) at GLM-5 shapes,
each against its torch reference path and its memory / compute bound.

Run on the GPU machine (about 2 minutes; ``--quick`` for a smoke run in seconds):

    PYTHONPATH=src python3 benchmarks/glm5_kernels_bench.py --out $OUT/glm5_kernels.json \
        [--sections mla,indexer,moe,moe_fp8,router] [--block-size 64] [--quick]

Sections (default: all):
  mla      absorbed sparse MLA decode (64 heads, latent 512 + rope 64, bf16, top-k 2048)
           over the paged latent cache: batch 1/16/64 at 16K context with one query row
           per request, batch 16 with 1+3 verify rows, and the dense path (context 1K);
           MLATritonBackend vs MLATorchBackend, both writing this step's latents
  indexer  DSA indexer scores + top-2048 select (32 heads x 128, bf16 keys): batch
           1/16/64 at 16K context and batch 8 at 128K, with the score width the step's
           context; then batch 1 and 32 at 1K and batch 32 at 16K with the width a
           CUDA graph of the engine uses (max_model_len, 128K + 256 under glm5_bench
           --long). IndexerTritonBackend (register "rows" select up to 32K keys a row,
           torch.topk beyond) vs IndexerTorchBackend (not run at the graph width), plus
           the parts the backend runs, each alone: the score kernel (score_ms) and the
           select it uses (select_ms; select_path names it), so triton_ms ~ score_ms +
           select_ms (+ the key write and the -1 fill). rows_ms (up to 32K keys) /
           radix_ms / topk_ms time the selects on the same rows whichever is used
           (radix_ms is never part of triton_ms; at 128K neither is rows_ms: rows that
           wide go to torch.topk)
  moe      routed experts (hidden 6144, moe_intermediate 2048, top-8, bf16) for 64
           experts at 1/16/64/512/4096 tokens and 256 experts at 1/64 tokens:
           fused_experts vs the eager sorted reference (and the graph reference,
           every expert over every token, where it fits)
  moe_fp8  the same cases with block-FP8 experts (float8_e4m3fn, 128x128 block scales):
           fused_experts_fp8 vs the bf16 fused_experts (its "torch_ms" column); bytes
           count one byte a weight. The bound's compute term still uses the bf16 matmul
           rate (FP8's is about twice), so compute-bound rows understate x_bound. At
           prefill sizes (8+ pairs an expert) also "m128_ms": 128-row tiles, 16 warps;
           "preq_ms": x quantized beforehand, as the model's FP8 norm hands it over (the
           fp8 column includes the quantizing launch at prefill sizes); "g1_ms": that
           pre-quantized x with the default tile in plain launch order (the default
           groups 8 row blocks)
  router   the float32 router's selection for 256 experts, top-8 (n_group 1, and 8/4 as
           DeepSeek-V3.2 has it): router_select vs grouped_topk's tail, 64 and 4096 tokens
  indexer_prefill, indexer_verify
           the indexer's query-tiled score kernel for prefill (4K/16K/64K prompts, a
           second 8K chunk) and verify rows (batch 64-256 x 1+3 at 16K), with a config
           sweep and the top-k selects: see benchmarks/indexer_sections.py (about 2.5
           minutes for both). Not in the default set
  indexer_fp8
           bf16 against fp8 indexer keys (--kv-cache-dtype fp8: e4m3 with a float32
           scale a key) on the same values, for decode (batch 1/16/64 at 16K, 8 at 128K),
           prefill (16K, a second 8K chunk) and verify (64/128 x 1+3 at 16K): the score
           kernel and IndexerTritonBackend.forward each way (and the score kernel with
           fp8 queries too: FP8 MMAs, not run by the engine), bytes-based roofline share
           (x_copy: each key once, D*2 or D+4 bytes, plus queries and the scores the
           select reads), the fp8 speedup, score error and top-k overlap. Not in the
           default set. ``--cpu-smoke`` runs indexer_prefill, indexer_verify and
           indexer_fp8 at toy shapes under TRITON_INTERPRET=1 on the CPU (CI's check of
           the code)

Bounds use the copy bandwidth and the bf16 matmul rate measured in the same call:
bound = max(bytes that must move / bandwidth, FLOPs / matmul rate). Bytes: MLA, the
selected latent rows (576 bf16 a key a query row) plus queries and outputs; indexer, every
context key once per query row; MoE, the weights of the experts the batch routes to plus
activations. Decode-sized cases are timed replayed from CUDA graphs (no launch overhead,
what a captured step pays) where the path is capturable; others with
``triton.testing.do_bench`` (medians). Prints a table per section, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _graph import capture_calls  # noqa: E402
from indexer_sections import (  # noqa: E402
    run_indexer_fp8,
    run_indexer_prefill,
    run_indexer_verify,
)

from pdserve.kernels._utils import interpret_mode  # noqa: E402
from pdserve.kernels.activation import quantize_fp8  # noqa: E402
from pdserve.kernels.dsa_indexer import (  # noqa: E402
    SORT_FREE_MAX_WIDTH,
    indexer_logits,
    topk_select,
)
from pdserve.kernels.dsa_select import REG_SELECT_MAX_WIDTH  # noqa: E402
from pdserve.kernels.fused_moe import fused_experts  # noqa: E402
from pdserve.kernels.fused_moe_fp8 import fused_experts_fp8  # noqa: E402
from pdserve.kernels.moe_router import router_select  # noqa: E402
from pdserve.kernels.reference import quantize_fp8_experts  # noqa: E402
from pdserve.layers.attention.backend import CommonAttentionMetadata  # noqa: E402
from pdserve.layers.attention.dsa import IndexerTorchBackend  # noqa: E402
from pdserve.layers.attention.dsa_triton import IndexerTritonBackend  # noqa: E402
from pdserve.layers.attention.mla import MLATorchBackend  # noqa: E402
from pdserve.layers.attention.mla_triton import MLATritonBackend  # noqa: E402
from pdserve.layers.moe import experts_dense, experts_sorted, grouped_topk  # noqa: E402

DT = torch.bfloat16
HEADS, LAT, ROPE, TOPK = 64, 512, 64, 2048
IDX_HEADS, IDX_DIM = 32, 128
HIDDEN, MOE_INTER, TOP_K = 6144, 2048, 8


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn``."""
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def bench_graph(fn: Callable[[], object], reps: int = 10) -> float:
    """Median milliseconds of one ``fn`` call replayed from a CUDA graph of ``reps`` calls."""
    return bench(capture_calls([fn] * reps).replay) / reps


def measure_limits() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s)."""
    src = torch.empty(1 << 29, dtype=DT, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 2 / (bench(partial(dst.copy_, src)) * 1e-3)
    a = torch.randn(8192, 8192, dtype=DT, device="cuda")
    flops = 2 * 8192**3 / (bench(partial(torch.matmul, a, a)) * 1e-3)
    torch.cuda.empty_cache()
    return bw, flops


def decode_metadata(
    batch: int, ctx: int, q_len: int, page: int, width: int | None = None
) -> CommonAttentionMetadata:
    """``batch`` requests of ``ctx`` tokens (the last ``q_len`` computed now), shuffled blocks.
    ``width``: the step's ``max_seq_len`` when it is not the context (a CUDA graph's is
    ``max_model_len``); block-table columns past the context point at the null block 0."""
    dev = torch.device("cuda")
    nblk = -(-ctx // page)
    bt = (1 + torch.randperm(batch * nblk, device=dev)).view(batch, nblk).to(torch.int32)
    if width is not None and -(-width // page) > nblk:
        bt = F.pad(bt, (0, -(-width // page) - nblk))
    pos = ctx - q_len + torch.arange(q_len, device=dev)
    slots = (bt[:, pos // page].long() * page + (pos % page)[None, :]).reshape(-1)
    return CommonAttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=batch * q_len,
        max_query_len=q_len,
        max_seq_len=width or ctx,
        block_size=page,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev) * q_len,
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        block_tables=bt,
        slot_mapping=slots,
        token_req_idx=torch.arange(batch, device=dev).repeat_interleave(q_len),
        token_q_idx=torch.arange(q_len, device=dev).repeat(batch),
    )


def _row(name: str, ms: float, ref_ms: float | None, nbytes: float, flops: float,
         bw: float, peak: float, **extra: Any) -> dict[str, Any]:  # fmt: skip
    bound = max(nbytes / bw, flops / peak) * 1e3
    row: dict[str, Any] = {"case": name, "triton_ms": ms, "torch_ms": ref_ms, "bound_ms": bound,
                           "x_bound": ms / bound, "GB/s": nbytes / (ms * 1e-3) / 1e9}  # fmt: skip
    if ref_ms is not None:
        row["speedup"] = ref_ms / ms
    row.update(extra)
    print(json.dumps(row), flush=True)
    return row


# ------------------------------------------------------------------------------- MLA
def run_mla(bw: float, peak: float, page: int, quick: bool) -> list[dict[str, Any]]:
    cases = [(1, 16384, 1), (16, 16384, 1), (64, 16384, 1), (16, 16384, 4), (16, 1024, 1)]
    if quick:
        cases = [(2, 4096, 1), (2, 1024, 1)]
    rows = []
    scale = (192 + 64) ** -0.5
    for batch, ctx, q_len in cases:
        md = decode_metadata(batch, ctx, q_len, page)
        t = md.num_actual_tokens
        cache = torch.randn(1 + batch * -(-ctx // page), page, LAT + ROPE, device="cuda", dtype=DT)
        q_lat = torch.randn(t, HEADS, LAT, device="cuda", dtype=DT)
        q_pe = torch.randn(t, HEADS, ROPE, device="cuda", dtype=DT)
        latent = torch.randn(t, LAT, device="cuda", dtype=DT)
        k_pe = torch.randn(t, ROPE, device="cuda", dtype=DT)
        topk = None
        if ctx > TOPK:  # each query row's own 2048 causal positions
            topk = torch.rand(t, ctx - q_len + 1, device="cuda").topk(TOPK).indices
        keys = min(ctx, TOPK)
        fast, ref = MLATritonBackend(max_model_len=ctx), MLATorchBackend()
        args = (q_lat, q_pe, latent, k_pe, cache, md, scale, topk)
        ms = bench_graph(partial(fast.forward, *args))
        ref_ms = bench_graph(partial(ref.forward, *args))
        nbytes = t * keys * (LAT + ROPE) * 2 + t * HEADS * (2 * LAT + ROPE) * 2
        flops = 2 * t * HEADS * keys * (2 * LAT + ROPE)
        name = f"b{batch} ctx{ctx} q{q_len}" + (" dense" if topk is None else "")
        rows.append(_row(name, ms, ref_ms, nbytes, flops, bw, peak))
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- indexer
GRAPH_WIDTH = 131072 + 256  # glm5_bench --long: max_model_len, every graph's score width


def run_indexer(bw: float, peak: float, page: int, quick: bool) -> list[dict[str, Any]]:
    cases: list[tuple[int, int, int | None]] = [
        (1, 16384, None), (16, 16384, None), (64, 16384, None), (8, 131072, None),
        (1, 1024, GRAPH_WIDTH), (32, 1024, GRAPH_WIDTH), (32, 16384, GRAPH_WIDTH),
    ]  # fmt: skip
    if quick:
        cases = [(2, 8192, None), (2, 1024, 40960)]
    rows = []
    for batch, ctx, graph_width in cases:
        md = decode_metadata(batch, ctx, 1, page, graph_width)
        t = md.num_actual_tokens
        cache = torch.randn(1 + batch * -(-ctx // page), page, IDX_DIM, device="cuda", dtype=DT)
        q = torch.randn(t, IDX_HEADS, IDX_DIM, device="cuda", dtype=DT)
        k = torch.randn(t, IDX_DIM, device="cuda", dtype=DT)
        w = torch.randn(t, IDX_HEADS, device="cuda") * IDX_HEADS**-0.5
        fast, ref = IndexerTritonBackend(), IndexerTorchBackend()
        args = (q, k, w, cache, md, TOPK, IDX_DIM**-0.5)
        ms = bench_graph(partial(fast.forward, *args))
        # the reference gathers the whole width: not at a graph's
        ref_ms = bench_graph(partial(ref.forward, *args)) if graph_width is None else None
        width = -(-md.max_seq_len // page) * page  # as the backend rounds it
        sort_free = width <= SORT_FREE_MAX_WIDTH  # the backend's choice (dsa_triton)
        place = (md.seq_lens, md.query_start_loc, md.token_req_idx, md.token_q_idx)
        score = partial(
            indexer_logits, q, w, cache, md.block_tables, *place, IDX_DIM**-0.5, t, width, TOPK
        )
        logits = score()  # radix select's input: rows up to their position only
        full = score(for_select=False)  # -inf past each position, as torch.topk needs
        score_ms = bench_graph(partial(score, for_select=sort_free))
        radix_ms = bench_graph(partial(topk_select, logits, *place, TOPK, t, variant="radix"))
        rows_ms = None
        if width <= REG_SELECT_MAX_WIDTH:
            rows_ms = bench_graph(partial(topk_select, logits, *place, TOPK, t, variant="rows"))
        topk_ms = bench_graph(partial(torch.topk, full, min(TOPK, width), dim=-1, sorted=False))
        path = ("rows" if width <= REG_SELECT_MAX_WIDTH else "radix") if sort_free else "torch.topk"
        nbytes = t * ctx * IDX_DIM * 2
        flops = 2 * t * ctx * IDX_HEADS * IDX_DIM
        name = f"b{batch} ctx{ctx}" + (f" width{width}" if graph_width else "")
        rows.append(
            _row(name, ms, ref_ms, nbytes, flops, bw, peak, score_ms=score_ms,
                 select_path=path, select_ms={"rows": rows_ms, "radix": radix_ms}.get(path, topk_ms),
                 rows_ms=rows_ms, radix_ms=radix_ms, topk_ms=topk_ms)
        )  # fmt: skip
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------- MoE
def _experts(e: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.empty(e, 2 * inter, HIDDEN, device="cuda", dtype=DT).normal_(0, HIDDEN**-0.5)
    w2 = torch.empty(e, HIDDEN, inter, device="cuda", dtype=DT).normal_(0, inter**-0.5)
    return w13, w2


def run_moe(bw: float, peak: float, quick: bool) -> list[dict[str, Any]]:
    cases = [(64, 1), (64, 16), (64, 64), (64, 512), (64, 4096), (256, 1), (256, 64)]
    inter = MOE_INTER
    if quick:
        cases, inter = [(16, 1), (16, 64)], 256
    rows = []
    loaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for e, t in cases:
        if e not in loaded:
            loaded.clear()
            torch.cuda.empty_cache()
            loaded[e] = _experts(e, inter)
        w13, w2 = loaded[e]
        x = torch.randn(t, HIDDEN, device="cuda", dtype=DT)
        ids = torch.rand(t, e, device="cuda").topk(TOP_K).indices
        weights = torch.rand(t, TOP_K, device="cuda")
        graph = t <= 64
        timer = bench_graph if graph else bench
        routed = (x, w13, w2, weights, ids)
        ms = timer(partial(fused_experts, *routed))
        ref_ms = bench(partial(experts_sorted, *routed))
        dense_ms = None
        if t <= 64:  # the graph reference runs every expert over every token
            dense_ms = bench_graph(partial(experts_dense, *routed))
        active = int(torch.unique(ids).numel())
        nbytes = active * 3 * HIDDEN * inter * 2 + t * HIDDEN * 2 * 2
        flops = 2 * t * TOP_K * 3 * HIDDEN * inter
        rows.append(
            _row(f"E{e} T{t}", ms, ref_ms, nbytes, flops, bw, peak,
                 active_experts=active, graph_ref_ms=dense_ms, graphed=graph)
        )  # fmt: skip
    return rows


# beside _fp8_config's at prefill sizes: (BLOCK_M, down BLOCK_N, warps[, group_m])
M128_TILES = (128, 128, 16)
UNGROUPED_TILES = (64, 128, 8, 1)  # the default tile in launch order (default: groups of 8)


def run_moe_fp8(bw: float, peak: float, quick: bool) -> list[dict[str, Any]]:
    cases = [(64, 1), (64, 16), (64, 64), (64, 512), (64, 4096), (256, 1), (256, 64)]
    inter = MOE_INTER
    if quick:
        cases, inter = [(16, 1), (16, 64)], 256
    rows = []
    loaded: dict[int, tuple[torch.Tensor, ...]] = {}
    for e, t in cases:
        if e not in loaded:
            loaded.clear()
            torch.cuda.empty_cache()
            w13, w2 = _experts(e, inter)
            loaded[e] = (w13, w2, *quantize_fp8_experts(w13, w2))
        w13, w2, q13, s13, q2, s2 = loaded[e]
        x = torch.randn(t, HIDDEN, device="cuda", dtype=DT)
        ids = torch.rand(t, e, device="cuda").topk(TOP_K).indices
        weights = torch.rand(t, TOP_K, device="cuda")
        graph = t <= 64
        timer = bench_graph if graph else bench
        ms = timer(partial(fused_experts_fp8, x, q13, s13, q2, s2, weights, ids))
        bf16_ms = timer(partial(fused_experts, x, w13, w2, weights, ids))
        # x as the model's FP8 path hands it over: quantized once by the norm before it
        xq = quantize_fp8(x)
        extra: dict[str, Any] = {
            "preq_ms": timer(partial(fused_experts_fp8, xq, q13, s13, q2, s2, weights, ids))
        }
        if t * TOP_K >= 8 * e:  # prefill sizes: the bf16 kernel's 128-row tile too
            extra["m128_ms"] = timer(partial(fused_experts_fp8, x, q13, s13, q2, s2, weights,
                                             ids, tiles=M128_TILES))  # fmt: skip
            extra["m128_tiles"] = list(M128_TILES)
            extra["g1_ms"] = timer(partial(fused_experts_fp8, xq, q13, s13, q2, s2, weights,
                                           ids, tiles=UNGROUPED_TILES))  # fmt: skip
            extra["g1_tiles"] = list(UNGROUPED_TILES)
        active = int(torch.unique(ids).numel())
        nbytes = active * 3 * HIDDEN * inter + t * HIDDEN * 2 * 2
        flops = 2 * t * TOP_K * 3 * HIDDEN * inter
        rows.append(
            _row(f"E{e} T{t} fp8", ms, bf16_ms, nbytes, flops, bw, peak,
                 active_experts=active, graphed=graph, **extra)
        )  # fmt: skip
    return rows


def run_router(bw: float, peak: float, quick: bool) -> list[dict[str, Any]]:
    e = 256
    rows = []
    for t in (64,) if quick else (64, 4096):
        for n_group, topk_group in ((1, 1), (8, 4)):
            logits = torch.randn(t, e, device="cuda")
            bias = torch.randn(e, device="cuda") * 0.1
            x = torch.randn(t, HIDDEN, device="cuda")
            w = torch.randn(e, HIDDEN, device="cuda") * HIDDEN**-0.5
            ms = bench_graph(
                partial(router_select, logits, bias, TOP_K, n_group, topk_group, True, 2.5)
            )
            ref_full = bench_graph(
                partial(grouped_topk, x, w, bias, TOP_K, n_group, topk_group, True, 2.5)
            )
            gemm = bench_graph(partial(F.linear, x, w))
            nbytes = t * e * 4 + t * TOP_K * 12
            rows.append(
                _row(f"T{t} groups {n_group}/{topk_group}", ms, ref_full - gemm, nbytes, 0.0,
                     bw, peak, gemm_ms=gemm, torch_with_gemm_ms=ref_full)
            )  # fmt: skip
    return rows


def table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n== {title}")
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(f"{k:>14}" for k in keys))
    for row in rows:
        vals = [row.get(k, "") for k in keys]
        cells = [f"{v:14.4g}" if isinstance(v, float) else f"{v!s:>14}" for v in vals]
        print(" | ".join(cells))


CPU_SECTIONS = ("indexer_prefill", "indexer_verify", "indexer_fp8")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--sections", default="mla,indexer,moe,moe_fp8,router")
    ap.add_argument("--block-size", type=int, default=64, help="KV cache block size")
    ap.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help=f"{', '.join(CPU_SECTIONS)} only, toy shapes on the CPU under TRITON_INTERPRET=1",
    )
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        bad = [s for s in args.sections.split(",") if s not in CPU_SECTIONS]
        if bad:
            sys.exit(f"--cpu-smoke runs only {', '.join(CPU_SECTIONS)}, not {', '.join(bad)}")
        if not interpret_mode():
            sys.exit("--cpu-smoke needs TRITON_INTERPRET=1 in the environment")
        from _interp import interpreter_fix

        interpreter_fix()  # Triton 3.6's interpreter under NumPy >= 2.3 (a no-op under pytest)
    elif not torch.cuda.is_available():
        sys.exit("glm5_kernels_bench.py needs a CUDA GPU (or --cpu-smoke)")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    bw, peak = (None, None) if args.cpu_smoke else measure_limits()
    result: dict[str, Any] = {
        "device": "cpu (interpreter)" if args.cpu_smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bandwidth_GBps": bw / 1e9 if bw else None,
        "bf16_matmul_TFLOPs": peak / 1e12 if peak else None,
        "block_size": args.block_size,
        "quick": args.quick,
        "cpu_smoke": args.cpu_smoke,
    }
    if bw and peak:
        print(
            f"{result['device']}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s"
        )
    runners: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "mla": lambda: run_mla(bw, peak, args.block_size, args.quick),
        "indexer": lambda: run_indexer(bw, peak, args.block_size, args.quick),
        "moe": lambda: run_moe(bw, peak, args.quick),
        "moe_fp8": lambda: run_moe_fp8(bw, peak, args.quick),
        "router": lambda: run_router(bw, peak, args.quick),
        "indexer_prefill": lambda: run_indexer_prefill(
            bw, peak, args.block_size, args.quick, args.cpu_smoke
        ),
        "indexer_verify": lambda: run_indexer_verify(
            bw, peak, args.block_size, args.quick, args.cpu_smoke
        ),
        "indexer_fp8": lambda: run_indexer_fp8(
            bw, peak, args.block_size, args.quick, args.cpu_smoke
        ),
    }
    chosen = args.sections.split(",")
    for name in chosen:
        if name not in runners:
            sys.exit(f"unknown section {name!r}; choose from {', '.join(runners)}")
    for name in chosen:
        with torch.inference_mode():
            result[name] = runners[name]()
    result["seconds"] = time.perf_counter() - t0
    for name in chosen:
        table(name, result[name])
    print(f"\n{result['seconds']:.0f} s")
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
