"""The ``indexer_prefill`` and ``indexer_verify`` sections of glm5_kernels_bench.py: the
DSA indexer's query-tiled score kernel (pdserve.kernels.dsa_indexer_tiled) against the
per-token kernel it replaces for prefill and verify rows, a small config sweep, and the
top-k selects on the same rows.

indexer_prefill  one request (32 index heads x 128, bf16 keys, top-2048) prefilling 4K,
                 16K and 64K tokens, and a second chunk (8K cached + 8K new). The score
                 kernel's configs are swept on the 16K case (each compiled once; every
                 point's scores checked against the per-token kernel's on the same
                 inputs: max_abs_diff over the causal entries); the other cases time the
                 per-token kernel, the default config and the sweep's best. Scores are
                 computed in the backend's token chunks (1 GiB of scores each: 64K runs in
                 4K-token chunks, with every score written for torch.topk since its width
                 is past SORT_FREE_MAX_WIDTH). Selects on the case's rows: "rows_bits" / "rows_hist"
                 (the row in registers, up to 32K keys; the K-th key found bit by bit, or
                 by byte histograms), "radix" (histogram passes), torch.topk over
                 fully written rows; max_abs_diff compares the selected scores with
                 torch.topk's. "backend" rows time IndexerTritonBackend.forward as a layer
                 calls it (key write, scores, select).
indexer_verify   batch 64/128/256 x (1+3) rows at 16K context (and batch 128 at the 32K
                 width of a CUDA graph), replayed from CUDA graphs: per-token kernel vs
                 the tiled one (a sweep of "rows" configs at batch 128), and the selects.

indexer_fp8      bf16 keys against fp8 keys with a float32 scale a key (--kv-cache-dtype
                 fp8) on the same values: decode batch 1/16/64 at 16K and 8 at 128K (the
                 per-token kernel), prefill 16K and a second 8K chunk, verify 64/128 x
                 (1+3) at 16K (the tiled kernel): the score kernel and the whole backend
                 forward each way, and the score kernel with fp8 queries too (FP8
                 MMAs), bytes-based roofline share (x_copy), the fp8 rows' speedup,
                 score error and top-k overlap (run_indexer_fp8).

FLOPs: 2 * causal (query, key) pairs * heads * dim (each score's dot products; the ReLU,
weights and head sum are not counted), over the rows the select reads: all rows when
every score is written (64K), else those with pos + 1 > top-k (the tiled kernel skips
the others, the per-token kernel scores them anyway); against the bf16 matmul rate
measured in the same call (x_matmul). Verify bytes: each request's keys once (ctx * dim * 2) plus the scores
written (rows * ctx * 4), against the copy bandwidth (x_copy).

With ``tiny`` (glm5_kernels_bench.py --cpu-smoke, under TRITON_INTERPRET=1) every code
path runs at toy shapes on the CPU with single wall-clock timings: a CI check that the
sections and their keys still work, not a measurement.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch
import triton
from _graph import capture_calls

from pdserve.kernels.dsa_indexer import SORT_FREE_MAX_WIDTH, indexer_logits, topk_select
from pdserve.kernels.dsa_indexer_tiled import (
    PREFILL_TILE,
    SMALL_QUERY_ROWS,
    TileConfig,
    indexer_logits_tiled,
    tile_grid,
    verify_config,
)
from pdserve.kernels.dsa_select import REG_SELECT_HIST, REG_SELECT_MAX_WIDTH
from pdserve.kernels.index_cache import (
    fp8_index_row_bytes,
    indexer_cache_views,
    quantize_index_queries,
    write_index_keys,
)
from pdserve.layers.attention.backend import CommonAttentionMetadata
from pdserve.layers.attention.dsa_triton import IndexerTritonBackend
from pdserve.layers.attention.paged_gather import token_chunks

CHUNK_BYTES = 1 << 30  # as IndexerTritonBackend (its _CHUNK_BYTES)


@dataclass(frozen=True)
class Shape:
    heads: int
    dim: int
    topk: int
    page: int


GLM5 = Shape(heads=32, dim=128, topk=2048, page=64)
TINY = Shape(heads=4, dim=16, topk=16, page=4)

# prefill cases: (context after the step, query tokens); the first is the sweep's
PREFILL_CASES = [(16384, 16384), (4096, 4096), (65536, 65536), (16384, 8192)]
PREFILL_QUICK = [(8192, 8192), (4096, 2048)]
PREFILL_TINY = [(48, 48), (40, 20)]
# verify: (batch, context, rows a request, score width or None: the context)
VERIFY_CASES = [(128, 16384, 4, None), (64, 16384, 4, None), (256, 16384, 4, None),
                (128, 16384, 4, 32768)]  # fmt: skip
VERIFY_QUICK = [(16, 8192, 4, None)]
VERIFY_TINY = [(2, 40, 4, None), (2, 24, 4, 48)]


def _cfg(variant: str, bt: int, bn: int, span: int, warps: int, stages: int) -> TileConfig:
    return TileConfig(variant, bt, bn, span, warps, stages)


# the prefill sweep (16K case): "heads" tiles of 64/128 tokens, "rows" tiles of 2-8
PREFILL_SWEEP = [
    PREFILL_TILE,
    _cfg("heads", 64, 128, 1024, 8, 3),
    _cfg("heads", 64, 128, 1024, 8, 2),  # the default until run 41
    _cfg("heads", 64, 64, 1024, 4, 3),
    _cfg("heads", 64, 256, 1024, 8, 2),
    _cfg("heads", 128, 128, 1024, 8, 2),
    _cfg("heads", 128, 64, 1024, 8, 3),
    _cfg("heads", 64, 128, 512, 8, 2),
    _cfg("heads", 64, 128, 2048, 8, 2),
    _cfg("rows", 4, 64, 1024, 4, 3),
    _cfg("rows", 4, 128, 1024, 4, 3),
    _cfg("rows", 4, 64, 1024, 4, 4),
    _cfg("rows", 8, 64, 1024, 8, 3),
    _cfg("rows", 8, 128, 1024, 8, 2),
    _cfg("rows", 2, 128, 1024, 4, 3),
]
PREFILL_SWEEP_QUICK = [PREFILL_TILE, _cfg("rows", 4, 64, 1024, 4, 3)]
PREFILL_SWEEP_TINY = [_cfg("heads", 16, 16, 32, 4, 2), _cfg("rows", 4, 16, 32, 4, 2)]
# the verify sweep (batch 128): "keys" tiles (the key block as the MMA's rows), then
# "rows" tiles (BT: the rows, 4)
VERIFY_SWEEP = [
    _cfg("keys", 8, 64, 1024, 4, 3),
    _cfg("keys", 8, 64, 1024, 8, 3),
    _cfg("keys", 8, 128, 1024, 8, 3),
    _cfg("keys", 8, 64, 1024, 4, 4),
    _cfg("keys", 8, 64, 2048, 4, 3),
    _cfg("keys", 8, 128, 1024, 8, 2),
    _cfg("rows", 8, 64, 1024, 4, 3),
    _cfg("rows", 8, 64, 512, 4, 3),
    _cfg("rows", 8, 64, 2048, 4, 3),
    _cfg("rows", 8, 128, 1024, 4, 3),
    _cfg("rows", 8, 64, 1024, 4, 2),
    _cfg("rows", 8, 64, 1024, 4, 4),
    _cfg("rows", 8, 64, 1024, 8, 3),
    _cfg("rows", 8, 128, 2048, 8, 3),
]
VERIFY_SWEEP_QUICK = VERIFY_SWEEP[:2]
VERIFY_SWEEP_TINY = [_cfg("rows", 4, 16, 32, 4, 2), _cfg("keys", 4, 16, 32, 4, 2)]


def cfg_name(cfg: TileConfig) -> str:
    return f"{cfg.variant} bt{cfg.bt} bn{cfg.bn} span{cfg.span} w{cfg.num_warps} s{cfg.num_stages}"


class Timer:
    """Median ms of a call: triton's do_bench (``graph``: one CUDA graph of ``reps``
    calls, as a captured step) on the GPU; one wall-clock call on the CPU (smoke)."""

    def __init__(self, device: torch.device) -> None:
        self.gpu = device.type == "cuda"

    def __call__(self, fn: Callable[[], object], graph: bool = False, reps: int = 10) -> float:
        if not self.gpu:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        if not graph:
            return float(triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median"))
        g = capture_calls([fn] * reps)
        ms = float(triton.testing.do_bench(g.replay, warmup=5, rep=40, return_mode="median"))
        return ms / reps


def metadata(
    batch: int, ctx: int, q_len: int, page: int, width: int, device: torch.device
) -> CommonAttentionMetadata:
    """``batch`` requests of ``ctx`` tokens, the last ``q_len`` computed now, on shuffled
    blocks (block 0 is the null block; columns up to ``width`` past the context too)."""
    nblk = -(-ctx // page)
    bt = (1 + torch.randperm(batch * nblk, device=device)).view(batch, nblk).to(torch.int32)
    bt = torch.nn.functional.pad(bt, (0, max(0, -(-width // page) - nblk)))
    pos = ctx - q_len + torch.arange(q_len, device=device)
    slots = (bt[:, pos // page].long() * page + (pos % page)[None, :]).reshape(-1)
    return CommonAttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=batch * q_len,
        max_query_len=q_len,
        max_seq_len=width,
        block_size=page,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len,
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        block_tables=bt,
        slot_mapping=slots,
        token_req_idx=torch.arange(batch, device=device).repeat_interleave(q_len),
        token_q_idx=torch.arange(q_len, device=device).repeat(batch),
    )


class Case:
    """Inputs of one case and the scoring calls on them, chunked over tokens as the
    backend chunks them."""

    def __init__(
        self, shape: Shape, batch: int, ctx: int, q_len: int, width: int, device: torch.device,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:  # fmt: skip
        self.shape, self.ctx, self.q_len = shape, ctx, q_len
        dt = torch.bfloat16
        self.md = md = metadata(batch, ctx, q_len, shape.page, width, device)
        self.t = t = md.num_actual_tokens
        self.width = width
        nblk = 1 + batch * -(-ctx // shape.page)
        self.cache = torch.randn(nblk, shape.page, shape.dim, device=device, dtype=dt)
        self.q = torch.randn(t, shape.heads, shape.dim, device=device, dtype=dt)
        self.k = torch.randn(t, shape.dim, device=device, dtype=dt)
        self.w = torch.randn(t, shape.heads, device=device) * shape.heads**-0.5
        self.scale = shape.dim**-0.5
        self.chunks = token_chunks(t, width * 4, chunk_bytes)
        self.sort_free = width <= SORT_FREE_MAX_WIDTH  # the backend's choice
        self.place = (md.seq_lens, md.query_start_loc, md.token_req_idx, md.token_q_idx)
        # FLOPs: 2 * causal pairs * heads * dim over the rows the select reads (queries
        # at positions ctx - q_len .. ctx - 1; pos + 1 > topk unless every score is written)
        lo = ctx - q_len if not self.sort_free else min(ctx, max(ctx - q_len, shape.topk))
        pairs = batch * (ctx * (ctx + 1) - lo * (lo + 1)) // 2  # sum of p + 1, p in [lo, ctx)
        self.flops = 2.0 * pairs * shape.heads * shape.dim
        self.key_bytes = batch * ctx * shape.dim * 2

    def old(self, a: int, b: int, for_select: bool) -> torch.Tensor:
        md = self.md
        place = (md.seq_lens, md.query_start_loc, md.token_req_idx[a:b], md.token_q_idx[a:b])
        return indexer_logits(self.q[a:b], self.w[a:b], self.cache, md.block_tables, *place,
                              self.scale, b - a, self.width, self.shape.topk, for_select)  # fmt: skip

    def tiled(
        self, a: int, b: int, for_select: bool, cfg: TileConfig | None, verify: bool = False
    ) -> torch.Tensor:
        md = self.md
        return indexer_logits_tiled(
            self.q, self.w, self.cache, md.block_tables, md.seq_lens, md.query_start_loc,
            md.num_reqs, md.max_query_len, a, b, self.scale, self.width, self.shape.topk,
            for_select=for_select, uniform=True, prefill=None if verify else cfg,
            verify=cfg if verify else None,
        )  # fmt: skip

    def run_all(self, score: Callable[[int, int], torch.Tensor]) -> None:
        for a, b in self.chunks:
            score(a, b)

    def max_diff(self, got: torch.Tensor, ref: torch.Tensor, a: int) -> float:
        """Max |got - ref| over the causal entries of the rows a.. the select reads
        (elsewhere -inf, or not written)."""
        pos = self.ctx - self.q_len + self.md.token_q_idx[a : a + got.shape[0]]
        causal = torch.arange(self.width, device=got.device)[None, :] <= pos[:, None]
        if self.sort_free:  # rows with pos + 1 <= topk: not scored for the select
            causal &= (pos >= self.shape.topk)[:, None]
        d = torch.where(causal, (got - ref).abs(), torch.zeros_like(got))
        return float(d.max()) if d.numel() else 0.0

    def select(self, logits: torch.Tensor, a: int, b: int, variant: str) -> torch.Tensor:
        place = (self.md.seq_lens, self.md.query_start_loc,
                 self.md.token_req_idx[a:b], self.md.token_q_idx[a:b])  # fmt: skip
        return topk_select(logits, *place, self.shape.topk, b - a, variant=variant)

    def topk(self, full: torch.Tensor) -> torch.Tensor:
        kk = min(self.shape.topk, self.width)
        vals, idx = full.topk(kk, dim=-1, sorted=False)
        return torch.where(vals > float("-inf"), idx, -1)


def _selected_diff(full: torch.Tensor, got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |difference| between the sorted scores two selections of the same rows take
    (positions -1 count as -inf on both sides)."""

    def taken(sel: torch.Tensor) -> torch.Tensor:
        s = full.gather(1, sel.clamp(min=0))
        return s.masked_fill(sel < 0, float("-inf")).sort(dim=1).values

    g, r = taken(got[:, : ref.shape[1]]), taken(ref)
    both = torch.isfinite(g) & torch.isfinite(r)
    if not bool((torch.isfinite(g) == torch.isfinite(r)).all()):
        return float("inf")
    return float((g - r).abs()[both].max()) if bool(both.any()) else 0.0


def _row(case: str, kernel: str, ms: float | None, **extra: Any) -> dict[str, Any]:
    row = {"case": case, "kernel": kernel, "ms": ms, **extra}
    print(json.dumps(row), flush=True)
    return row


def _time_cfg(
    timer: Timer, c: Case, cfg: TileConfig | None, ref: list[torch.Tensor], verify: bool,
    graph: bool,
) -> tuple[float | None, float | None, str | None]:  # fmt: skip
    """(ms of every chunk's scores, max diff to the per-token kernel on the checked
    chunks, error) of the tiled kernel with ``cfg``."""
    try:
        diff = 0.0
        for (a, b), r in zip(c.chunks, ref, strict=False):  # ref: the first chunks only
            diff = max(diff, c.max_diff(c.tiled(a, b, c.sort_free, cfg, verify), r, a))
        ms = timer(lambda: c.run_all(partial(c.tiled, for_select=c.sort_free, cfg=cfg,
                                             verify=verify)), graph=graph)  # fmt: skip
        return ms, diff, None
    except Exception as e:  # a config that does not compile / fit: recorded, not fatal
        return None, None, f"{type(e).__name__}: {str(e)[:200]}"


def _perf(c: Case, ms: float | None, peak: float | None, bw: float | None) -> dict[str, Any]:
    if ms is None:
        return {}
    out: dict[str, Any] = {"TFLOP/s": c.flops / (ms * 1e-3) / 1e12}
    if peak:
        out["x_matmul"] = c.flops / (ms * 1e-3) / peak
    return out


def run_indexer_prefill(
    bw: float | None, peak: float | None, page: int, quick: bool, tiny: bool = False,
    budget_s: float = 80.0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Rows of the prefill section (see the module doc); the sweep stops adding configs
    past ``budget_s`` seconds (the skipped ones get a row with error "budget")."""
    device = torch.device("cpu" if tiny else "cuda")
    shape = TINY if tiny else replace(GLM5, page=page)  # tiny: its own toy block size
    cases = PREFILL_TINY if tiny else PREFILL_QUICK if quick else PREFILL_CASES
    sweep = PREFILL_SWEEP_TINY if tiny else PREFILL_SWEEP_QUICK if quick else PREFILL_SWEEP
    default = sweep[0]  # PREFILL_TILE (the tiny sweep's first: a toy tile)
    timer = Timer(device)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    best: TileConfig | None = None
    for i, (ctx, q_len) in enumerate(cases):
        width = -(-ctx // shape.page) * shape.page
        # tiny: chunks of 24 tokens, so the chunked paths run too
        c = Case(shape, 1, ctx, q_len, width, device, 24 * width * 4 if tiny else CHUNK_BYTES)
        name = f"prefill {q_len} (cached {ctx - q_len})"
        # the per-token kernel's scores of the first chunks: the reference of every config
        ref = [c.old(a, b, c.sort_free) for a, b in c.chunks[:2]]
        old_ms = timer(lambda c=c: c.run_all(partial(c.old, for_select=c.sort_free)))
        rows.append(_row(name, "old per-token", old_ms, **_perf(c, old_ms, peak, bw)))
        configs = sweep if i == 0 else [default] + ([best] if best and best != default else [])
        timed: list[tuple[float, TileConfig]] = []
        for cfg in configs:
            if time.perf_counter() - t0 > budget_s and cfg is not default:
                rows.append(_row(name, "tiled " + cfg_name(cfg), None, error="budget"))
                continue
            ms, diff, err = _time_cfg(timer, c, cfg, ref, False, False)
            rows_q = min(c.q_len, c.chunks[0][1])
            _, span, grid = tile_grid(cfg, shape.heads, rows_q, 1, width, device)
            rows.append(
                _row(name, "tiled " + cfg_name(cfg), ms, max_abs_diff=diff, error=err,
                     default=cfg == PREFILL_TILE, span_used=span, grid=list(grid),
                     speedup=old_ms / ms if ms else None, **_perf(c, ms, peak, bw))
            )  # fmt: skip
            if ms is not None:
                timed.append((ms, cfg))
        if timed:
            ms, cfg = min(timed, key=lambda x: x[0])
            if i == 0:
                best = cfg
            rows.append(_row(name, "best", ms, config=asdict(cfg), speedup=old_ms / ms,
                             **_perf(c, ms, peak, bw)))  # fmt: skip
        rows += _selects(c, name, timer, graph=False)
        be = IndexerTritonBackend()
        cache = c.cache.clone()
        fwd = partial(be.forward, c.q, c.k, c.w, cache, c.md, shape.topk, c.scale)
        ms = timer(fwd)
        rows.append(_row(name, "backend", ms, **_perf(c, ms, peak, bw)))
        del c, ref, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _selects(c: Case, name: str, timer: Timer, graph: bool) -> list[dict[str, Any]]:
    """Each select over the case's rows (every chunk), checked against torch.topk's."""
    wide = c.width > REG_SELECT_MAX_WIDTH
    variants = ["radix"] if wide else ["rows_bits", "rows_hist", "radix"]
    rows = []
    a, b = c.chunks[-1]  # the longest rows: the check
    full = c.tiled(a, b, False, None)
    sparse = c.tiled(a, b, True, None)
    want = c.topk(full)
    for v in variants:
        diff = _selected_diff(full, c.select(sparse, a, b, v), want)
        if len(c.chunks) == 1:
            ms = timer(partial(c.select, sparse, a, b, v), graph=graph)
        else:  # each chunk's scores, computed untimed
            ms = 0.0
            for a2, b2 in c.chunks:
                s2 = c.tiled(a2, b2, True, None)
                ms += timer(partial(c.select, s2, a2, b2, v))
        default = "rows_hist" if REG_SELECT_HIST else "rows_bits"
        used = c.sort_free and v == ("radix" if wide else default)
        rows.append(_row(name, f"select {v}", ms, max_abs_diff=diff, used=used))
    if len(c.chunks) == 1:
        ms = timer(partial(c.topk, full), graph=graph)
    else:
        ms = 0.0
        for a2, b2 in c.chunks:
            f2 = c.tiled(a2, b2, False, None)
            ms += timer(partial(c.topk, f2))
    rows.append(_row(name, "select torch.topk", ms, max_abs_diff=0.0, used=not c.sort_free))
    return rows


def run_indexer_verify(
    bw: float | None, peak: float | None, page: int, quick: bool, tiny: bool = False,
    budget_s: float = 40.0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Rows of the verify section (see the module doc)."""
    device = torch.device("cpu" if tiny else "cuda")
    shape = TINY if tiny else replace(GLM5, page=page)  # tiny: its own toy block size
    cases = VERIFY_TINY if tiny else VERIFY_QUICK if quick else VERIFY_CASES
    sweep = VERIFY_SWEEP_TINY if tiny else VERIFY_SWEEP_QUICK if quick else VERIFY_SWEEP
    timer = Timer(device)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    best: TileConfig | None = None
    default = verify_config(cases[0][2], shape.heads)
    for i, (batch, ctx, q_len, gw) in enumerate(cases):
        if q_len > SMALL_QUERY_ROWS:
            raise ValueError(f"verify rows {q_len} > SMALL_QUERY_ROWS {SMALL_QUERY_ROWS}")
        width = gw or -(-ctx // shape.page) * shape.page
        c = Case(shape, batch, ctx, q_len, width, device)
        name = f"verify b{batch} x {q_len} ctx{ctx}" + (f" width{width}" if gw else "")
        nbytes = c.key_bytes + batch * q_len * ctx * 4  # keys once + the scores written
        old_bytes = c.key_bytes * q_len + batch * q_len * ctx * 4  # keys once per row

        def perf(ms: float | None, nb: float, c: Case = c) -> dict[str, Any]:
            if ms is None:
                return {}
            out = {"GB/s": nb / (ms * 1e-3) / 1e9, **_perf(c, ms, peak, bw)}
            if bw:
                out["x_copy"] = nb / (ms * 1e-3) / bw
            return out

        ref = [c.old(a, b, c.sort_free) for a, b in c.chunks[:1]]
        old_ms = timer(lambda c=c: c.run_all(partial(c.old, for_select=c.sort_free)), graph=True)
        rows.append(_row(name, "old per-token", old_ms, **perf(old_ms, old_bytes)))
        configs = sweep if i == 0 else [default] + ([best] if best and best != default else [])
        if default not in configs:
            configs = [default] + configs
        timed = []
        for cfg in configs:
            if time.perf_counter() - t0 > budget_s and cfg is not default:
                rows.append(_row(name, "tiled " + cfg_name(cfg), None, error="budget"))
                continue
            ms, diff, err = _time_cfg(timer, c, cfg, ref, True, True)
            bt, span, grid = tile_grid(cfg, shape.heads, q_len, batch, width, device)
            rows.append(
                _row(name, "tiled " + cfg_name(cfg), ms, max_abs_diff=diff, error=err,
                     default=cfg == default, bt_used=bt, span_used=span, grid=list(grid),
                     speedup=old_ms / ms if ms else None, **perf(ms, nbytes))
            )  # fmt: skip
            if ms is not None:
                timed.append((ms, cfg))
        if timed:
            ms, cfg = min(timed, key=lambda x: x[0])
            if i == 0:
                best = cfg
            rows.append(_row(name, "best", ms, config=asdict(cfg), speedup=old_ms / ms,
                             **perf(ms, nbytes)))  # fmt: skip
        rows += _selects(c, name, timer, graph=True)
        del c, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ indexer_fp8
# (kind, batch, context, query rows a request): decode (the per-token kernel), prefill
# and verify (the tiled kernel), each with bf16 keys and with fp8 keys + per-key scales
FP8_CASES = [("decode", 1, 16384, 1), ("decode", 16, 16384, 1), ("decode", 64, 16384, 1),
             ("decode", 8, 131072, 1), ("prefill", 1, 16384, 16384),
             ("prefill", 1, 16384, 8192), ("verify", 64, 16384, 4),
             ("verify", 128, 16384, 4)]  # fmt: skip
FP8_QUICK = [("decode", 2, 8192, 1), ("prefill", 1, 4096, 2048), ("verify", 16, 8192, 4)]
FP8_TINY = [("decode", 3, 40, 1), ("prefill", 1, 40, 20), ("verify", 2, 40, 4)]


def _fp8_cache(c: Case) -> torch.Tensor:
    """The case's keys in an fp8 indexer cache (uint8, each key with its float32 scale)."""
    nblk, page, d = c.cache.shape
    raw = torch.zeros(nblk, page * fp8_index_row_bytes(d), dtype=torch.uint8,
                      device=c.cache.device)  # fmt: skip
    keys, scales = indexer_cache_views(raw, d)
    slots = torch.arange(nblk * page, device=raw.device)
    write_index_keys(keys, scales, slots, c.cache.view(-1, d))
    return raw


def _fp8_score(
    c: Case, keys: torch.Tensor, k_scale: torch.Tensor | None, a: int, b: int, for_select: bool,
    qw: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Scores of tokens a..b as the backend computes them (decode: the per-token kernel);
    ``qw``: (queries, weights) other than the case's (fp8 queries)."""
    md, s = c.md, c.shape
    q, w = qw or (c.q, c.w)
    if c.q_len == 1:
        place = (md.seq_lens, md.query_start_loc, md.token_req_idx[a:b], md.token_q_idx[a:b])
        return indexer_logits(q[a:b], w[a:b], keys, md.block_tables, *place, c.scale,
                              b - a, c.width, s.topk, for_select, k_scale=k_scale)  # fmt: skip
    return indexer_logits_tiled(
        q, w, keys, md.block_tables, md.seq_lens, md.query_start_loc, md.num_reqs,
        md.max_query_len, a, b, c.scale, c.width, s.topk, for_select=for_select, uniform=True,
        k_scale=k_scale,
    )  # fmt: skip


def _overlap(got: torch.Tensor, want: torch.Tensor, width: int) -> float:
    """Mean share of each row's selected positions (``want``) that ``got`` selects too."""
    rows = min(got.shape[0], 256)  # the last rows: the longest contexts
    got, want = got[-rows:], want[-rows:]
    mask = torch.zeros(rows, width + 1, dtype=torch.bool, device=got.device)
    mask.scatter_(1, torch.where(got >= 0, got, width), True)
    hit = mask.gather(1, want.clamp(min=0)) & (want >= 0)
    return float(hit.sum() / (want >= 0).sum().clamp(min=1))


def run_indexer_fp8(
    bw: float | None, peak: float | None, page: int, quick: bool, tiny: bool = False
) -> list[dict[str, Any]]:
    """bf16 keys against fp8 keys (one float32 scale a key, ``--kv-cache-dtype fp8``) for
    the indexer's decode, prefill and verify scores, on the same key values. Per case:
    "score bf16" / "score fp8" (the score kernel the backend uses, every token chunk) and
    "backend bf16" / "backend fp8" (IndexerTritonBackend.forward: key write, scores,
    select; over fp8 keys it quantizes the queries too, since run 44), "score fp8":
    fp8 keys with model-dtype queries (the engine's fp8 path before run 44), and "score
    fp8 k+q": fp8 queries too (one scale a token and head, folded into the weights;
    quantized outside the timing), so the dots are FP8 MMAs, as the backend's fp8 path
    runs them. Bytes: each request's keys once (D * 2 bf16, D + 4 fp8 a key) + the queries
    + the scores the select reads (4 a causal pair); x_copy = bytes / ms over the copy
    bandwidth (the memory-roofline share), x_matmul as the other sections. fp8 rows:
    speedup over bf16, max_rel_diff (scores' max |fp8 - bf16| over the largest |score|)
    and select_overlap (the share of the bf16 backend's top-k the fp8 one selects too)."""
    device = torch.device("cpu" if tiny else "cuda")
    shape = TINY if tiny else replace(GLM5, page=page)
    cases = FP8_TINY if tiny else FP8_QUICK if quick else FP8_CASES
    timer = Timer(device)
    rows: list[dict[str, Any]] = []
    for kind, batch, ctx, q_len in cases:
        width = -(-ctx // shape.page) * shape.page
        chunk = 24 * width * 4 if tiny and kind == "prefill" else CHUNK_BYTES
        c = Case(shape, batch, ctx, q_len, width, device, chunk)
        name = f"{kind} b{batch} x {q_len} ctx{ctx}"
        graph = kind != "prefill"  # as a captured step (prefill runs eagerly)
        raw = _fp8_cache(c)
        keys, k_scale = indexer_cache_views(raw, shape.dim)
        pairs = c.flops / (2 * shape.heads * shape.dim)
        q_elems = c.t * shape.heads * shape.dim
        q8 = quantize_index_queries(c.q, c.w)  # the fp8 q variant's (queries, weights)
        ms_of: dict[str, float] = {}
        a, b = c.chunks[-1]
        full: dict[str, torch.Tensor] = {}
        outs = {}
        for label, cache, ks, qw, key_row, q_bytes in (
            ("bf16", c.cache, None, None, shape.dim * 2, q_elems * 2),
            ("fp8", keys, k_scale, None, shape.dim + 4, q_elems * 2),
            ("fp8 k+q", keys, k_scale, q8, shape.dim + 4, q_elems),
        ):
            fn = partial(_fp8_score, c, cache, ks, for_select=c.sort_free, qw=qw)
            try:
                full[label] = _fp8_score(c, cache, ks, a, b, False, qw)
                ms = timer(lambda fn=fn, c=c: c.run_all(fn), graph=graph)
            except Exception as e:  # the FP8-MMA variant not compiling: recorded, not fatal
                if label != "fp8 k+q":
                    raise
                rows.append(_row(name, f"score {label}", None,
                                 error=f"{type(e).__name__}: {str(e)[:200]}"))  # fmt: skip
                continue
            nbytes = batch * ctx * key_row + q_bytes + pairs * 4
            extra: dict[str, Any] = {"bytes": nbytes, "GB/s": nbytes / (ms * 1e-3) / 1e9,
                                     **_perf(c, ms, peak, bw)}  # fmt: skip
            if bw:
                extra["x_copy"] = nbytes / (ms * 1e-3) / bw
            if label != "bf16":
                big = float(full["bf16"][torch.isfinite(full["bf16"])].abs().max())
                diff = c.max_diff(full[label], full["bf16"], a) / max(big, 1e-30)
                extra.update(speedup=ms_of["score bf16"] / ms, max_rel_diff=diff)
            ms_of[f"score {label}"] = ms
            rows.append(_row(name, f"score {label}", ms, **extra))
        for label, cache in (("bf16", c.cache.clone()), ("fp8", raw.clone())):
            be = IndexerTritonBackend()
            fwd = partial(be.forward, c.q, c.k, c.w, cache, c.md, shape.topk, c.scale)
            outs[label] = fwd()
            ms = timer(fwd, graph=graph)
            extra = {}
            if label == "fp8":
                extra = {"speedup": ms_of["backend bf16"] / ms,
                         "select_overlap": _overlap(outs["fp8"], outs["bf16"], width)}  # fmt: skip
            ms_of[f"backend {label}"] = ms
            rows.append(_row(name, f"backend {label}", ms, **extra))
        del c, raw, full, outs, q8
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
