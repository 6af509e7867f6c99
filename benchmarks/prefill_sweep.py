"""Launch-shape sweeps of the GLM-5 kernels that set prefill and verify speed (issues 26
and 27): the absorbed sparse MLA kernel and the fused MoE, each config timed on the same
inputs, checked against the default config's output, and set against the bf16 matmul
rate and the copy bandwidth measured in the same call.

    PYTHONPATH=src python3 benchmarks/prefill_sweep.py --out $OUT/sweep.json \\
        [--sections mla,moe,mla_variants] [--budget-s 240]
    python3 benchmarks/prefill_sweep.py --device cpu --out /tmp/sweep.json   (smoke)

mla   64 heads, kv_lora_rank 512 + rope 64, bf16, top-k 2048, KV block 64 (glm5-m12-e64).
      Cases: one request prefilling 2K tokens (every row within top-k: dense causal), 4K
      and 16K (rows past 2048 read their own 2048 selected keys); verify steps of
      64/128/256 requests x 4 rows at 16K context; decode steps of 64/128/256 x 1 row.
      Each config (heads per program, keys per tile, warps, stages) runs with the split
      count the backend would choose for it. FLOPs = 2 * pairs * heads * (2 * 512 + 64)
      (scores over 576 dims, values over 512), pairs = sum over rows of the keys a row
      reads (min(pos + 1, 2048)); bytes = pairs * 576 * 2 (each row's gathered latents,
      read once per head block) + queries and outputs. Prefill is timed eagerly (as the
      engine runs it), verify and decode replayed from CUDA graphs.
mla_variants  prefill (16K, 4K, 2K as in mla), then verify 64/128/256 x 4 and decode
      128/256 x 1 at 16K: the
      general kernel at its WIDE default (the reference output) and at its prefill shape,
      against each variant of
      kernels/sparse_mla_prefill.py (candidate rows resolved once per layer by a small
      kernel, timed apart as rows_ms; total_ms = both) and of the Gluon kernel
      (kernels/sparse_mla_gluon.py, Hopper only: skipped elsewhere). Same FLOP formula.
      Each case also times a kernel that only reads the candidate rows
      (benchmarks/_gather_bound.py): gathered bytes = pairs * 576 * 2, its TB/s, and
      each kernel's share of that bound (gather ms / its total ms).
moe   routed experts of one MoE layer (hidden 6144, moe_intermediate 2048, top-8 of 64,
      bf16) at 8192 and 16384 tokens first (prefill: the serve default's chunk, a 16K
      prompt, in launch pairs of CHUNK_TOKENS), then 2048, 512 and 1024 (verify steps of
      128 and 256 requests x 4 rows; graph replays) and 4096: FLOPs = 2 * T * 8 * 3 *
      6144 * 2048, bytes = every expert's weights once (all 64 are reached). Configs:
      tiles, warps, stages, the program order (group_m > 1: row blocks sweep the column
      tiles together), the tokens a launch pair takes (chunk_tokens: at 16K, one pair
      instead of four, the experts' weights read once) and the down GEMM's column tile
      (down_n).

``--device cpu`` runs every code path at tiny shapes under Triton's interpreter, with the
defaults and one other config of each grid (a smoke run for the test suite, not a
measurement). Rows go to the JSON as they finish; a table
per section and the best config per case are printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _graph import capture_calls  # noqa: E402
from _interp import bench_device  # noqa: E402

from pdserve.profiling.prefill_flops import mla_pair_flops  # noqa: E402

# (heads per program, keys per tile, warps, stages); the defaults are among them
MLA_GRID = [
    (32, 32, 4, 3),
    (16, 64, 8, 2),
    (64, 16, 8, 3),
    (64, 16, 8, 4),
    (64, 32, 8, 2),
    (64, 32, 8, 3),
    (64, 32, 8, 4),
    (64, 64, 8, 2),
]
# (block_m, block_n, block_k, warps, stages[, group_m[, chunk_tokens]]): MoeConfig
MOE_GRID = [  # (block_m, block_n, block_k, warps, stages, group_m, chunk_tokens, down_n)
    (128, 128, 64, 8, 3, 8, 0, 256),  # the down GEMM in 128 x 256 tiles (MoeConfig.down_n)
    (128, 128, 64, 8, 4, 8, 0, 256),
    (128, 128, 64, 8, 3, 16, 0, 256),
    (128, 128, 128, 8, 2, 8),  # 128-deep K steps, two stages (192 KB of shared memory)
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 8, 3, 1, 0, 256),
    (128, 128, 64, 8, 3, 1, 4096),  # launch pairs of 4K tokens (the weights read per pair)
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 3, 4),  # grouped program order (MoeConfig.group_m)
    (128, 128, 64, 8, 3, 16),
    (128, 128, 32, 8, 5),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 64, 128, 4, 4),
    (64, 256, 64, 8, 3),
    (128, 64, 64, 4, 4),
    # verify-sized batches (64-128 pairs an expert: the weights' bytes bound, issue 27)
    (64, 128, 128, 4, 3, 8),
    (64, 128, 64, 4, 4, 8, 0, 256),
    (128, 128, 128, 8, 2, 8, 0, 256),
    (64, 64, 64, 4, 4, 8),
]
MOE_TOKENS = (8192, 16384, 2048, 512, 1024, 4096)


@dataclass(frozen=True)
class Shapes:
    heads: int
    lat: int
    rope: int
    topk: int
    page: int
    hidden: int
    inter: int
    experts: int
    top_k: int


GPU = Shapes(64, 512, 64, 2048, 64, 6144, 2048, 64, 8)
CPU = Shapes(64, 32, 16, 16, 4, 64, 32, 8, 2)


# ------------------------------------------------------------------------------ timing
def _median_ms(fn: Callable[[], object], dev: torch.device, reps: int) -> float:
    if dev.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton

    return float(triton.testing.do_bench(fn, warmup=5, rep=reps, return_mode="median"))


def _graph_ms(fn: Callable[[], object], dev: torch.device, reps: int) -> float:
    """One call's median ms replayed from a CUDA graph of 10 calls (eager on the CPU)."""
    if dev.type != "cuda":
        return _median_ms(fn, dev, reps)
    return _median_ms(capture_calls([fn] * 10).replay, dev, reps) / 10


def measure(dev: torch.device) -> tuple[float, float]:
    """(copy bytes/s read + written, bf16 matmul FLOP/s); nominal ones on the CPU."""
    if dev.type != "cuda":
        return 1e11, 1e12
    from gpu_suite import measure_limits

    lim = measure_limits()
    return lim["copy_bandwidth_Bps"], lim["bf16_matmul_flops"]


# --------------------------------------------------------------------------------- MLA
@dataclass
class MlaCase:
    name: str
    kind: str  # prefill | verify | decode
    reqs: int
    ctx: int
    q_len: int
    # as the model hands them over: each row's top-k in position order (the select writes
    # them so) and the query a [T, H, L] view of the [H, T, L] W_UK product; such a case
    # times the default kernel only, against the same case in score order
    model_layout: bool = False


def mla_cases(cpu: bool) -> list[MlaCase]:
    if cpu:
        return [MlaCase("prefill 12", "prefill", 1, 12, 12), MlaCase("prefill 40", "prefill", 1, 40, 40),
                MlaCase("verify 3x4", "verify", 3, 24, 4),
                MlaCase("prefill 40 model layout", "prefill", 1, 40, 40,
                        model_layout=True)]  # fmt: skip
    out = [MlaCase(f"prefill {n // 1024}K", "prefill", 1, n, n) for n in (2048, 4096, 16384)]
    out.append(MlaCase("prefill 16K model layout", "prefill", 1, 16384, 16384, model_layout=True))
    out += [MlaCase(f"verify {b}x4 16K", "verify", b, 16384, 4) for b in (64, 128, 256)]
    out += [MlaCase(f"decode {b}x1 16K", "decode", b, 16384, 1) for b in (64, 128, 256)]
    return out


def _mla_inputs(case: MlaCase, sh: Shapes, dev: torch.device) -> dict[str, Any]:
    from pdserve.layers.attention.backend import CommonAttentionMetadata

    g = torch.Generator(device=dev).manual_seed(case.reqs * 7919 + case.ctx)
    nblk = -(-case.ctx // sh.page)
    bt = (1 + torch.randperm(case.reqs * nblk, device=dev, generator=g)).view(case.reqs, nblk)
    t = case.reqs * case.q_len
    pos = (case.ctx - case.q_len + torch.arange(case.q_len, device=dev)).repeat(case.reqs)
    md = CommonAttentionMetadata(
        num_reqs=case.reqs,
        num_actual_tokens=t,
        max_query_len=case.q_len,
        max_seq_len=case.ctx,
        block_size=sh.page,
        query_start_loc=torch.arange(case.reqs + 1, dtype=torch.int32, device=dev) * case.q_len,
        seq_lens=torch.full((case.reqs,), case.ctx, dtype=torch.int32, device=dev),
        block_tables=bt.to(torch.int32),
        slot_mapping=torch.zeros(t, dtype=torch.int64, device=dev),
        token_req_idx=torch.arange(case.reqs, device=dev).repeat_interleave(case.q_len),
        token_q_idx=torch.arange(case.q_len, device=dev).repeat(case.reqs),
    )
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cache = torch.randn(1 + case.reqs * nblk, sh.page, sh.lat + sh.rope, device=dev,
                        generator=g).to(dt)  # fmt: skip
    q_lat = torch.randn(t, sh.heads, sh.lat, device=dev, generator=g).to(dt)
    if case.model_layout:  # the same values as a [T, H, L] view of [H, T, L] storage
        q_lat = q_lat.transpose(0, 1).contiguous().transpose(0, 1)
    q_pe = torch.randn(t, sh.heads, sh.rope, device=dev, generator=g).to(dt)
    topk = None
    if case.ctx > sh.topk:  # each row's own selection among its causal keys, -1 pads
        topk = torch.empty(t, sh.topk, dtype=torch.int64, device=dev)
        for a in range(0, t, 2048):
            b = min(t, a + 2048)
            r = torch.rand(b - a, case.ctx, device=dev, generator=g)
            r.masked_fill_(torch.arange(case.ctx, device=dev)[None, :] > pos[a:b, None], -1.0)
            vals, idx = r.topk(sh.topk, dim=-1)
            topk[a:b] = torch.where(vals >= 0, idx, -1)
            if case.model_layout:  # ascending positions, the -1 pads last
                big = torch.iinfo(torch.int64).max
                srt = torch.where(topk[a:b] >= 0, topk[a:b], big).sort(dim=-1).values
                topk[a:b] = torch.where(srt == big, -1, srt)
    pairs = int(torch.clamp(pos + 1, max=sh.topk).sum())
    return {"md": md, "cache": cache, "q_lat": q_lat, "q_pe": q_pe, "topk": topk, "pairs": pairs}


def run_mla(sh: Shapes, dev: torch.device, bw: float, peak: float, deadline: float,
            reps: int) -> list[dict[str, Any]]:  # fmt: skip
    from pdserve.kernels._utils import num_sms
    from pdserve.kernels.sparse_mla import MlaConfig, _config, choose_splits, sparse_mla_attention

    rows: list[dict[str, Any]] = []
    grid = [MlaConfig(*c) for c in (MLA_GRID[4:5] if dev.type == "cpu" else MLA_GRID)]
    for case in mla_cases(dev.type == "cpu"):
        inp = _mla_inputs(case, sh, dev)
        md, t = inp["md"], inp["md"].num_actual_tokens
        default = _config(t, sh.heads, max(16, sh.lat))
        bound = sh.topk if inp["topk"] is not None else case.ctx

        def call(cfg: MlaConfig, splits: int, out: torch.Tensor, inp: dict = inp,
                 md: Any = md, t: int = t) -> torch.Tensor:  # fmt: skip
            return sparse_mla_attention(
                inp["q_lat"], inp["q_pe"], inp["cache"], md.block_tables, md.seq_lens,
                md.query_start_loc, md.token_req_idx, md.token_q_idx, inp["topk"],
                0.0625, t, splits, out, config=cfg,
            )  # fmt: skip

        ref = call(default, choose_splits(t, sh.heads, bound, num_sms(dev), sh.lat),
                   torch.empty_like(inp["q_lat"])).float()  # fmt: skip
        flops = inp["pairs"] * mla_pair_flops(sh.heads, sh.lat, sh.rope)
        for cfg in [default] + [c for c in grid if c != default]:
            if time.perf_counter() > deadline:
                rows.append({"case": case.name, "config": list(cfg), "skipped": "budget"})
                continue
            splits = choose_splits(t, sh.heads, bound, num_sms(dev), sh.lat, cfg)
            blocks = -(-sh.heads // cfg.block_h)
            nbytes = inp["pairs"] * (sh.lat + sh.rope) * 2 * blocks + t * sh.heads * (
                2 * sh.lat + sh.rope) * 2  # fmt: skip
            out = torch.empty_like(inp["q_lat"])
            row: dict[str, Any] = {"case": case.name, "kind": case.kind, "config": list(cfg),
                                   "default": cfg == default, "splits": splits}  # fmt: skip
            try:
                got = call(cfg, splits, out).float()
                row["max_abs_diff"] = float((got - ref).abs().max())
                timer = _median_ms if case.kind == "prefill" else _graph_ms
                ms = timer(partial(call, cfg, splits, out), dev, reps)
            except Exception as e:  # out of shared memory, registers: the config is out
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            row.update(ms=ms, tflops=flops / ms / 1e9, share_of_matmul=flops / (ms * 1e-3) / peak,
                       gbps=nbytes / (ms * 1e-3) / 1e9,
                       x_bound=ms / (max(flops / peak, nbytes / bw) * 1e3))  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del inp, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------ MLA variants
BASELINES = [(64, 32, 8, 3), (64, 64, 8, 2)]  # the general kernel: WIDE default, sweep best


def run_mla_variants(sh: Shapes, dev: torch.device, bw: float, peak: float, deadline: float,
                     reps: int) -> list[dict[str, Any]]:  # fmt: skip
    """Prefill, then verify and decode batches of 128+ rows: the general kernel (its WIDE default,
    the reference output, and its prefill shape) against each variant of kernels/sparse_mla_prefill.py
    on the same inputs. A variant's ``ms`` is its attention kernel; ``rows_ms`` (once per
    case) is :func:`candidate_rows`, run once per layer, and ``total_ms`` the two."""
    from pdserve.kernels import sparse_mla_gluon as gluon
    from pdserve.kernels.sparse_mla import MlaConfig, sparse_mla_attention
    from pdserve.kernels.sparse_mla_prefill import VARIANTS, candidate_rows, sparse_mla_prefill

    rows: list[dict[str, Any]] = []
    cpu = dev.type == "cpu"
    every = mla_cases(cpu)
    pre = [c for c in every if c.kind == "prefill" and not c.model_layout][::-1]
    # the longest first (16K counts), then the same in the model's layout (one kernel)
    cases = pre[:1] + [c for c in every if c.model_layout] + pre[1:]
    # then verify and decode batches of 128+ rows (kernels without split-K: a program a
    # row fills the GPU from about one row a multiprocessor), where the engine could use
    # the same kernels
    cases += [c for c in every if c.kind in ("verify", "decode")
              and (cpu or c.reqs * c.q_len >= 128)]  # fmt: skip
    for case in cases:
        inp = _mla_inputs(case, sh, dev)
        md, t = inp["md"], inp["md"].num_actual_tokens
        topk = inp["topk"]
        if topk is None:  # every row within top-k: the indexer's selection is all causal keys
            topk = torch.full((t, sh.topk), -1, dtype=torch.int64, device=dev)
        flops = inp["pairs"] * mla_pair_flops(sh.heads, sh.lat, sh.rope)
        args = (md.block_tables, md.seq_lens, md.query_start_loc, md.token_req_idx,
                md.token_q_idx)  # fmt: skip

        def general(cfg: MlaConfig, out: torch.Tensor, inp: dict = inp, t: int = t,
                    args: tuple = args, topk: torch.Tensor = topk) -> torch.Tensor:  # fmt: skip
            return sparse_mla_attention(inp["q_lat"], inp["q_pe"], inp["cache"], *args, topk,
                                        0.0625, t, 1, out, config=cfg)  # fmt: skip

        def resolve(args: tuple = args, topk: torch.Tensor = topk,
                    t: int = t) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
            return candidate_rows(*args, topk, sh.page, t)

        ref = general(MlaConfig(*BASELINES[0]), torch.empty_like(inp["q_lat"])).float()
        cand, ncand = resolve()
        rows_ms = _median_ms(resolve, dev, reps)
        gather_ms = _gather_ms(inp["cache"], cand, ncand, t, sh, dev, reps)
        gbytes = inp["pairs"] * (sh.lat + sh.rope) * inp["cache"].element_size()
        entries: list[tuple[str, Callable[[torch.Tensor], object]]] = [
            (f"general {list(c)}", partial(general, MlaConfig(*c))) for c in BASELINES
        ]
        entries += [(name, partial(sparse_mla_prefill, inp["q_lat"], inp["q_pe"], inp["cache"],
                                   cand, ncand, 0.0625, t, variant=name))
                    for name in VARIANTS]  # fmt: skip
        # the Gluon kernel (Hopper, 16-bit operands): same arguments
        entries += [(name, partial(gluon.sparse_mla_prefill_gluon, inp["q_lat"], inp["q_pe"],
                                   inp["cache"], cand, ncand, 0.0625, t, variant=name))
                    for name in gluon.VARIANTS]  # fmt: skip
        if case.model_layout:  # the engine's prefill variant only (and the reference)
            from pdserve.layers.attention.mla_triton import PREFILL_VARIANT

            entries = [e for e in entries if e[0] in (f"general {list(BASELINES[0])}",
                                                      PREFILL_VARIANT or "")]  # fmt: skip
        gluon_ok = gluon.supported(inp["q_lat"], inp["q_pe"], inp["cache"])
        for label, fn in entries:
            variant = not label.startswith("general")
            row: dict[str, Any] = {"case": case.name, "kind": case.kind, "config": label,
                                   "default": label == f"general {list(BASELINES[0])}",
                                   "gather_ms": gather_ms,
                                   "gather_tbps": gbytes / (gather_ms * 1e-3) / 1e12}  # fmt: skip
            if variant:
                row["variant"] = list(VARIANTS[label]) if label in VARIANTS else label
            if time.perf_counter() > deadline:
                rows.append({**row, "skipped": "budget"})
                continue
            if label in gluon.VARIANTS and not gluon_ok:
                rows.append({**row, "skipped": "the Gluon kernel needs Hopper and 16-bit operands"})
                continue
            out = torch.empty_like(inp["q_lat"])
            try:
                got = fn(out)
                assert got is out
                row["max_abs_diff"] = float((out.float() - ref).abs().max())
                ms = _median_ms(partial(fn, out), dev, reps)
            except Exception as e:  # out of shared memory, registers: the variant is out
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            total = ms + (rows_ms if variant else 0.0)
            row.update(ms=ms, tflops=flops / ms / 1e9, share_of_matmul=flops / (ms * 1e-3) / peak,
                       rows_ms=rows_ms if variant else 0.0, total_ms=total,
                       total_share=flops / (total * 1e-3) / peak,
                       share_of_gather=gather_ms / total,
                       tbps=gbytes / (total * 1e-3) / 1e12)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del inp, ref, cand, ncand
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _gather_ms(cache: torch.Tensor, cand: torch.Tensor, ncand: torch.Tensor, t: int,
               sh: Shapes, dev: torch.device, reps: int) -> float:  # fmt: skip
    """The gather bound (benchmarks/_gather_bound.py): ms of the faster config of a kernel
    that only reads the candidate rows; checked against its reference on small cases."""
    import _gather_bound as gb

    best = float("inf")
    for cfg in gb.CONFIGS:
        out = gb.gather_rows(cache, cand, ncand, t, sh.lat, sh.rope, cfg)
        if t <= 64:
            want = gb.gather_reference(cache, cand, ncand, t)
            torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-2)
        best = min(best, _median_ms(partial(gb.gather_rows, cache, cand, ncand, t, sh.lat,
                                            sh.rope, cfg, out), dev, reps))  # fmt: skip
    return best


def _variants_table(rows: list[dict[str, Any]]) -> None:
    print("\n== mla_variants: prefill, ms of the attention kernel (TFLOP/s, share of the bf16 "
          "matmul rate), + candidate_rows = total (share); max abs diff vs the general "
          "kernel's default; gather: the gather-only kernel's ms over the total (share of "
          "the gather bound)")  # fmt: skip
    print(f"{'case':>12} {'config':>26} {'ms':>9} {'TFLOP/s':>8} {'share':>6} {'total ms':>9} "
          f"{'share':>6} {'max diff':>9} {'gather':>7}")  # fmt: skip
    case = None
    for r in rows:
        if r["case"] != case:  # the case's gather bound first
            case = r["case"]
            print(f"{case:>12} {'gather only (the bound)':>26} {r['gather_ms']:9.3f} "
                  f"{r['gather_tbps']:6.2f} TB/s of gathered rows")  # fmt: skip
        if "ms" not in r:
            why = r.get("error", r.get("skipped", "-"))
            print(f"{r['case']:>12} {r['config']:>26} {why}")
            continue
        print(f"{r['case']:>12} {r['config']:>26} {r['ms']:9.3f} {r['tflops']:8.0f} "
              f"{r['share_of_matmul']:6.0%} {r['total_ms']:9.3f} {r['total_share']:6.0%} "
              f"{r['max_abs_diff']:9.2e} {r['share_of_gather']:7.0%}")  # fmt: skip


# --------------------------------------------------------------------------------- MoE
def run_moe(sh: Shapes, dev: torch.device, bw: float, peak: float, deadline: float,
            reps: int, tokens: tuple[int, ...] = MOE_TOKENS) -> list[dict[str, Any]]:  # fmt: skip
    from pdserve.kernels.fused_moe import MoeConfig, _config, fused_experts

    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(5)
    w13 = (torch.randn(sh.experts, 2 * sh.inter, sh.hidden, device=dev, generator=g)
           * sh.hidden**-0.5).to(dt)  # fmt: skip
    w2 = (torch.randn(sh.experts, sh.hidden, sh.inter, device=dev, generator=g)
          * sh.inter**-0.5).to(dt)  # fmt: skip
    rows: list[dict[str, Any]] = []
    # the serve default's 8K prefill chunks first: the budget may end the sweep early
    for t in (32,) if dev.type == "cpu" else tokens:
        x = torch.randn(t, sh.hidden, device=dev, generator=g).to(dt)
        ids = torch.rand(t, sh.experts, device=dev, generator=g).topk(sh.top_k).indices
        weights = torch.rand(t, sh.top_k, device=dev, generator=g)
        default = _config(t * sh.top_k, sh.experts)
        ref = fused_experts(x, w13, w2, weights, ids, config=default).float()
        flops = 2 * t * sh.top_k * 3 * sh.hidden * sh.inter
        nbytes = 3 * sh.experts * sh.hidden * sh.inter * 2 + 2 * t * sh.hidden * 2
        # the CPU smoke: one 64-row tile, in grouped order
        cpu_grid = [(64, 128, 64, 4, 4, 2)]
        grid = [MoeConfig(*c) for c in (cpu_grid if dev.type == "cpu" else MOE_GRID)]
        for cfg in [default] + [c for c in grid if c != default]:
            row: dict[str, Any] = {"case": f"T{t}", "config": list(cfg), "default": cfg == default}
            if time.perf_counter() > deadline:
                rows.append({**row, "skipped": "budget"})
                continue
            out = torch.empty_like(x)
            fn = partial(fused_experts, x, w13, w2, weights, ids, out, cfg)
            try:
                fn()
                row["max_abs_diff"] = float((out.float() - ref).abs().max())
                ms = (_graph_ms if t <= 1024 else _median_ms)(fn, dev, reps)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            row.update(ms=ms, tflops=flops / ms / 1e9, share_of_matmul=flops / (ms * 1e-3) / peak,
                       x_bound=ms / (max(flops / peak, nbytes / bw) * 1e3))  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ------------------------------------------------------------------------------ report
def best_per_case(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: the default config's ms and the fastest config (errors, skips left out)."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        timed = [r for r in rows if r["case"] == case and "ms" in r]
        if not timed:
            continue
        best = min(timed, key=lambda r: r["ms"])
        default = next((r for r in timed if r.get("default")), None)
        out.append({"case": case, "best_config": best["config"], "best_ms": best["ms"],
                    "best_tflops": best["tflops"], "best_share": best["share_of_matmul"],
                    "default_ms": default["ms"] if default else None})  # fmt: skip
    return out


def _table(name: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n== {name}: ms (TFLOP/s, share of the bf16 matmul rate) per config")
    cfgs = list(dict.fromkeys(tuple(r["config"]) for r in rows))
    print(f"{'case':>18} | " + " | ".join(f"{str(c):>22}" for c in cfgs))
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = []
        for c in cfgs:
            r = next((r for r in rows if r["case"] == case and tuple(r["config"]) == c), None)
            if r is None or "ms" not in r:
                cells.append(f"{('err' if r and 'error' in r else '-'):>22}")
            else:
                mark = "*" if r.get("default") else " "
                cells.append(f"{r['ms']:8.3f} ({r['tflops']:5.0f}, {r['share_of_matmul']:4.0%}){mark}")
        print(f"{case:>18} | " + " | ".join(cells))
    for b in best_per_case(rows):
        d = f"{b['default_ms']:.3f}" if b["default_ms"] is not None else "-"
        print(f"  {b['case']}: best {b['best_config']} {b['best_ms']:.3f} ms "
              f"({b['best_share']:.0%} of matmul), default {d} ms")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="mla,moe")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop timing new configs after")
    ap.add_argument("--moe-tokens", default=",".join(map(str, MOE_TOKENS)),
                    help="the moe section's token counts, in order")  # fmt: skip
    args = ap.parse_args(argv)
    dev = bench_device(args.device)
    if dev is None:
        return 2
    sh = GPU if dev.type == "cuda" else CPU
    t0 = time.perf_counter()
    bw, peak = measure(dev)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "copy_bandwidth_Bps": bw,
        "bf16_matmul_flops": peak,
        "shapes": sh.__dict__,
    }
    print(f"{res['device']}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    runners = {"mla": run_mla, "moe": run_moe, "mla_variants": run_mla_variants}
    sections = args.sections.split(",")
    for name in sections:
        if name not in runners:
            print(f"unknown section {name!r}; choose from {', '.join(runners)}", file=sys.stderr)
            return 2
    deadline = t0 + args.budget_s
    reps = 1 if dev.type == "cpu" else 80
    moe = {"tokens": tuple(int(x) for x in args.moe_tokens.split(","))}
    with torch.inference_mode():
        for name in sections:
            res[name] = runners[name](sh, dev, bw, peak, deadline, reps,
                                      **(moe if name == "moe" else {}))  # fmt: skip
            res[f"{name}_best"] = best_per_case(res[name])
            Path(args.out).write_text(json.dumps(res, indent=2))
    res["seconds"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(res, indent=2))
    for name in sections:
        if name == "mla_variants":
            _variants_table(res[name])
        else:
            _table(name, res[name])
    print(f"\n{res['seconds']:.0f} s; medians: "
          + ", ".join(f"{n} {statistics.median([r['ms'] for r in res[n] if 'ms' in r] or [0]):.3f} ms"
                      for n in sections))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
