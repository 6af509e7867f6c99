"""``pdserve plan``: predict, from measured single-role curves, the capacity of every
way to split N GPUs into colocated instances or x prefill + y decode instances, for one
request shape (input/output length) and an SLA on mean TTFT and mean TPOT.

Curves (a JSON file; ``benchmarks/gpu_suite.py`` writes this shape, so its result file
can be passed as is):

* ``prefill_curve`` (preferred where present) or ``prefill``: ``{"tokens": L, "tok_s": T}``
  or a list of them: prefill throughput of one GPU at prompt length ``L`` (the suite's
  ``prefill_curve`` packs short prompts into full steps, as a serving engine does). Between points, the time per prompt is interpolated
  linearly in ``L``; with one point, throughput is taken as constant in ``L``.
* ``decode``: a list of ``{"batch": B, "ctx": C, "step_ms": S}``: the decode step time of
  one GPU at batch ``B`` and context ``C`` (``async_step_ms`` is preferred where present:
  the engine's default is async scheduling; points without a time are skipped),
  interpolated bilinearly (clamped at the grid's
  edges; beyond the largest batch, linear extrapolation from the last two batches).
* optional ``num_kv_blocks`` and ``block_size`` (default 16): the KV capacity of one GPU,
  which bounds the requests a decode (or colocated) instance holds at once;
  ``max_num_seqs`` (default 256) bounds it too; ``kv_transfer_ms`` (default 0) is added to
  every P/D TTFT.

The model (each assumption is a place where a measurement can disagree):

* Requests arrive as a Poisson stream of rate λ, spread evenly over the instances of a
  role. A prefill instance serves prompts one at a time (service ``S_p`` = prompt time),
  so its TTFT is an M/D/1 wait plus ``S_p``: ``W = ρ S_p / (2 (1 - ρ))``, ``ρ = λ_i S_p``.
* A decode instance holds ``B`` requests, each for ``output_len`` steps, so by Little's
  law ``B = λ_i · output_len · TPOT``; TPOT is the step time at ``B`` and the mean context
  ``input_len + output_len / 2`` (a fixed point, solved by iteration).
* Colocated: one GPU interleaves both. Prefill takes ``λ_i S_p`` of its time and decode
  steps share the rest, so ``TPOT = step(B) / (1 - λ_i S_p)``; a prompt is prefilled in
  chunks of ``max_num_batched_tokens`` tokens, each chunk riding on a decode step, so its
  service is ``S_p + ceil(L / chunk) · step(B)``, queued M/D/1 as above.
* P/D TTFT = prefill wait + ``S_p`` + ``kv_transfer_ms`` + one decode step.

Capacity is the largest λ (found by bisection) at which predicted mean TTFT and mean TPOT
meet the SLA and no instance is saturated or over its KV capacity.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.errors import BenchError


@dataclass(frozen=True)
class Curves:
    prefill: list[tuple[int, float]]  # (prompt tokens, seconds per prompt), sorted
    decode: dict[int, list[tuple[int, float]]]  # batch -> [(ctx, step seconds)] sorted
    kv_tokens: int | None
    max_num_seqs: int
    kv_transfer_s: float

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Curves:
        raw_p = data.get("prefill_curve") or data.get("prefill")
        if isinstance(raw_p, dict):
            raw_p = [raw_p]
        raw_p = [p for p in raw_p or [] if "tok_s" in p]  # points the suite skipped have none
        if not raw_p:
            raise BenchError("curves: 'prefill' needs at least one {tokens, tok_s} point")
        prefill = sorted((int(p["tokens"]), int(p["tokens"]) / float(p["tok_s"])) for p in raw_p)
        decode: dict[int, list[tuple[int, float]]] = {}
        for d in data.get("decode") or []:
            ms = d.get("async_step_ms", d.get("step_ms"))  # the default engine runs async
            if ms is None:  # a point the suite skipped (e.g. no KV room)
                continue
            decode.setdefault(int(d["batch"]), []).append((int(d["ctx"]), float(ms) / 1e3))
        if not decode:
            raise BenchError("curves: 'decode' needs {batch, ctx, step_ms} points")
        for pts in decode.values():
            pts.sort()
        blocks = data.get("num_kv_blocks")
        kv_tokens = int(blocks) * int(data.get("block_size", 16)) if blocks else None
        return cls(
            prefill,
            decode,
            kv_tokens,
            int(data.get("max_num_seqs", 256)),
            float(data.get("kv_transfer_ms", 0.0)) / 1e3,
        )

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill one prompt of ``tokens`` on one GPU."""
        pts = self.prefill
        if len(pts) == 1:
            return pts[0][1] * tokens / pts[0][0]
        return _interp([p[0] for p in pts], [p[1] for p in pts], tokens, extrapolate=True)

    def step_s(self, batch: float, ctx: float) -> float:
        """Seconds of one decode step at ``batch`` requests of context ``ctx``."""
        batches = sorted(self.decode)

        def at(b: int) -> float:
            pts = self.decode[b]
            return _interp([p[0] for p in pts], [p[1] for p in pts], ctx, extrapolate=False)

        if len(batches) == 1:
            return at(batches[0])
        return _interp(batches, [at(b) for b in batches], max(batch, 1.0), extrapolate=True)


def _interp(xs: Sequence[float], ys: Sequence[float], x: float, *, extrapolate: bool) -> float:
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i <= 0:
        if not extrapolate:
            return ys[0]
        i = 1
    elif i >= len(xs):
        if not extrapolate:
            return ys[-1]
        i = len(xs) - 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class Shape:
    input_len: int
    output_len: int
    ttft_s: float
    tpot_s: float
    chunk_tokens: int = 8192


@dataclass
class Prediction:
    layout: str  # "colocated x8" or "3P5D"
    prefill_gpus: int
    decode_gpus: int
    capacity_rps: float
    ttft_ms: float  # predicted at capacity
    tpot_ms: float
    output_tok_s_per_gpu: float
    limited_by: str


def _mdl_wait(rate: float, service: float) -> float:
    rho = rate * service
    return math.inf if rho >= 1.0 else rho * service / (2.0 * (1.0 - rho))


def _decode_batch(c: Curves, rate: float, s: Shape, stretch: float = 0.0) -> tuple[float, float]:
    """(batch, TPOT seconds) of a decode-holding instance fed ``rate`` req/s; ``stretch``
    is the share of its time taken by prefill (colocated)."""
    ctx = s.input_len + s.output_len / 2
    batch, tpot = 1.0, 0.0
    for _ in range(200):
        tpot = c.step_s(batch, ctx) / max(1e-9, 1.0 - stretch)
        new = max(1.0, rate * s.output_len * tpot)
        if abs(new - batch) < 1e-3 * batch:
            batch = new
            break
        batch = 0.5 * (batch + new)
    return batch, c.step_s(batch, ctx) / max(1e-9, 1.0 - stretch)


def _batch_limit(c: Curves, s: Shape) -> float:
    limit = float(c.max_num_seqs)
    if c.kv_tokens is not None:
        limit = min(limit, c.kv_tokens / (s.input_len + s.output_len))
    return limit


def colocated(c: Curves, s: Shape, rate: float) -> tuple[float, float, str]:
    """(TTFT s, TPOT s, '' or what fails) of one colocated GPU at ``rate``."""
    sp = c.prefill_s(s.input_len)
    share = rate * sp
    if share >= 1.0:
        return math.inf, math.inf, "prefill saturates the GPU"
    batch, tpot = _decode_batch(c, rate, s, stretch=share)
    if batch > _batch_limit(c, s):
        return math.inf, tpot, "KV capacity / max_num_seqs"
    service = sp + math.ceil(s.input_len / s.chunk_tokens) * c.step_s(batch, s.input_len)
    return _mdl_wait(rate, service) + service, tpot, ""


def disaggregated(c: Curves, s: Shape, rate_p: float, rate_d: float) -> tuple[float, float, str]:
    """(TTFT s, TPOT s, '' or what fails) of a P/D pair of instances at these rates."""
    sp = c.prefill_s(s.input_len)
    if rate_p * sp >= 1.0:
        return math.inf, math.inf, "prefill saturated"
    batch, tpot = _decode_batch(c, rate_d, s)
    if batch > _batch_limit(c, s):
        return math.inf, tpot, "decode KV capacity / max_num_seqs"
    first_step = c.step_s(batch, s.input_len)
    return _mdl_wait(rate_p, sp) + sp + c.kv_transfer_s + first_step, tpot, ""


def _capacity(meets: Any, hi: float = 1.0) -> float:
    """Largest rate at which ``meets(rate)`` holds (monotone), by bracketing + bisection."""
    if not meets(1e-6):
        return 0.0
    lo = 1e-6
    while meets(hi) and hi < 1e7:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def plan(c: Curves, s: Shape, num_gpus: int) -> list[Prediction]:
    """Every layout of ``num_gpus`` GPUs (colocated, and xPyD for x + y = N), best first."""
    out: list[Prediction] = []

    def ok(ttft: float, tpot: float, why: str) -> bool:
        return not why and ttft <= s.ttft_s and tpot <= s.tpot_s

    def colo(rate: float) -> tuple[float, float, str]:
        return colocated(c, s, rate / num_gpus)

    cap = _capacity(lambda r: ok(*colo(r)))
    out.append(_prediction(f"colocated x{num_gpus}", 0, num_gpus, cap, colo, s, c, num_gpus))
    for x in range(1, num_gpus):
        pd = _pd_at(c, s, x, num_gpus - x)
        cap = _capacity(lambda r, pd=pd: ok(*pd(r)))
        out.append(_prediction(f"{x}P{num_gpus - x}D", x, num_gpus - x, cap, pd, s, c, num_gpus))
    out.sort(key=lambda p: -p.capacity_rps)
    return out


def _pd_at(c: Curves, s: Shape, x: int, y: int) -> Callable[[float], tuple[float, float, str]]:
    """The P/D prediction of ``x`` prefill and ``y`` decode GPUs as a function of the rate."""

    def at(rate: float) -> tuple[float, float, str]:
        return disaggregated(c, s, rate / x, rate / y)

    return at


def _prediction(
    name: str, xp: int, yd: int, cap: float, fn: Any, s: Shape, c: Curves, n: int
) -> Prediction:
    ttft, tpot, _ = fn(cap) if cap > 0 else (math.inf, math.inf, "")
    if ttft >= 0.99 * s.ttft_s:
        why = "TTFT"
    elif tpot >= 0.99 * s.tpot_s:
        why = "TPOT"
    else:  # a hard limit: what fails just past the capacity
        why = fn(cap * 1.01 + 1e-6)[2] or "TTFT"
    return Prediction(name, xp, yd, cap, ttft * 1e3, tpot * 1e3, cap * s.output_len / n, why)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curves", required=True, help="JSON of measured curves (see module doc)")
    p.add_argument("--input-len", type=int, required=True)
    p.add_argument("--output-len", type=int, required=True)
    p.add_argument("--num-gpus", type=int, required=True)
    p.add_argument("--sla-ttft-ms", type=float, default=2500.0)
    p.add_argument("--sla-tpot-ms", type=float, default=20.0)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="prefill chunk of a colocated instance (its engine setting)",
    )
    p.add_argument("--json", default=None, help="also write the predictions here")


def main(args: argparse.Namespace) -> int:
    try:
        if args.num_gpus < 1 or args.input_len < 1 or args.output_len < 1:
            raise BenchError("--num-gpus, --input-len and --output-len must be >= 1")
        curves = Curves.from_json(json.loads(Path(args.curves).read_text()))
    except (OSError, ValueError, KeyError, BenchError) as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    shape = Shape(
        args.input_len,
        args.output_len,
        args.sla_ttft_ms / 1e3,
        args.sla_tpot_ms / 1e3,
        args.max_num_batched_tokens,
    )
    preds = plan(curves, shape, args.num_gpus)
    print(
        f"{args.input_len}/{args.output_len} tokens, {args.num_gpus} GPU(s), SLA mean TTFT <= "
        f"{args.sla_ttft_ms:g} ms, mean TPOT <= {args.sla_tpot_ms:g} ms"
    )
    print(f"{'layout':<16}{'req/s':>9}{'TTFT ms':>10}{'TPOT ms':>9}{'tok/s/GPU':>11}  limited by")
    for p in preds:
        print(
            f"{p.layout:<16}{p.capacity_rps:>9.2f}{p.ttft_ms:>10.0f}{p.tpot_ms:>9.1f}"
            f"{p.output_tok_s_per_gpu:>11.0f}  {p.limited_by}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(p) for p in preds], indent=2) + "\n")
    return 0
