"""The DSA indexer's top-k select at prefill size (issue 26): each select variant on the
score rows a GLM-5 prefill hands it, checked against ``torch.topk``, timed.

    PYTHONPATH=src python3 benchmarks/select_bench.py --out $OUT/select.json
    python3 benchmarks/select_bench.py --device cpu --out /tmp/select.json   (smoke)

Cases (top-k 2048, float32 score rows as the indexer writes them): a 16K prompt in the
serve default's two 8K-token chunks (rows at positions 0..8191 in an 8K-wide buffer,
then 8192..16383 in a 16K-wide one), a 4K prompt in one chunk, and the last 4K-token
chunk of a 64K prompt (64K-wide rows: the backend hands them to ``torch.topk``), then
decode-sized selects at a 16K context, 1 and 32 rows, timed as CUDA-graph replays (at
one row the select is one program's latency, not bandwidth), where the register selects
also run on 16 and 32 warps (``rows_hist@32w``), with rows just past half the buffer as
two tiles (``rows_bits@tail16``: :data:`pdserve.kernels.dsa_select.REG_SELECT_TAIL`), and
the split select on other shapes
(``split@c8,s1024,w8/8``: 8 programs a row, a 1,024-key sample, 8 warps for its scan and
its pick; :mod:`pdserve.kernels.dsa_select_split`).
Variants (:data:`pdserve.kernels.dsa_indexer.SELECT_VARIANTS`): ``rows_bits`` and
``rows_hist`` (the row in registers, up to 32K keys; the K-th key found bit by bit, or by
byte histograms), ``radix`` (histogram passes over memory), and ``torch.topk`` over rows
with -inf past each position. Per case and variant: ms (triton do_bench, median
of 50 ms of calls), the scores read (sum over rows past top-k of pos + 1, 4 bytes each)
as GB/s against the copy bandwidth measured in the same call, and whether its selection
has the same scores as ``torch.topk``'s (``exact``). The variant the indexer backend
runs by default is marked. ``--device cpu`` runs the code path at tiny shapes under
Triton's interpreter (a smoke run for the test suite, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _graph import capture_calls  # noqa: E402
from _interp import bench_device  # noqa: E402

GPU_CASES = {
    "prefill 16K": ((0, 8192), (8192, 16384)),
    "prefill 4K": ((0, 4096),),
    "prefill 64K, last 4K": ((61440, 65536),),  # past REG_SELECT_MAX_WIDTH: no rows_*
    # decode-sized (timed as graph replays): one row, and 32 rows, at a 16K context
    "decode 1 x 16K": ((16383, 16384),),
    "decode 32 x 16K": ((16352, 16384),),
    # glm5_bench's 1 x 16K decode: a row just past 16K keys in the 32K-wide score buffer
    # of the graphs (dsa_triton.graph_context_widths): the register select's widest path
    "decode 1 x 16K, 32K graph": ((16392, 16393),),
    # spec_bench's verify at 192 streams x (1 + 3): 768 rows just past 16K keys each
    "decode verify 768 rows past 16K, 32K graph": ((16400, 17168),),
}
# score buffers wider than the context
WIDTHS = {"decode 1 x 16K, 32K graph": 32768, "decode 1 x 40, 64 graph": 64,
          "decode verify 768 rows past 16K, 32K graph": 32768}  # fmt: skip
CPU_CASES = {"prefill 48": ((0, 24), (24, 48)), "decode 1 x 40, 64 graph": ((40, 41),)}
GPU_TOPK, CPU_TOPK = 2048, 16
# the split select's shapes beside its default on the decode cases
SPLIT_SHAPES = ("c8", "c64", "s1024", "s4096", "w8/8", "w4/4", "s1024,w8/4")
SPLIT_SHAPES_CPU = ("c2,s256,w8/4",)  # the interpreter's time goes with the sample


def _split_shape(v: str) -> dict[str, Any]:
    """``split@c8,s1024,w8/4`` -> split_topk_select's chunks, sample and warps."""
    kw: dict[str, Any] = {}
    for part in v.split("@", 1)[1].split(","):
        if part[0] == "c":
            kw["chunks"] = int(part[1:])
        elif part[0] == "s":
            kw["sample"] = int(part[1:])
        else:
            scan, pick = part[1:].split("/")
            kw["warps"] = (int(scan), int(pick))
    return kw


def _chunk(
    a: int, b: int, dev: torch.device, g: torch.Generator, width: int | None = None
) -> dict[str, Any]:
    """Score rows of the prompt tokens a..b-1 (one request), as the indexer leaves them
    (``width``: the buffer's, default ``b``; scores past a row's position are not read)."""
    q = b - a
    logits = torch.randn(q, width or b, device=dev, generator=g)
    return {
        "logits": logits,
        "seq_lens": torch.tensor([b], dtype=torch.int32, device=dev),
        "qsl": torch.tensor([0, q], dtype=torch.int32, device=dev),
        "req": torch.zeros(q, dtype=torch.int64, device=dev),
        "qidx": torch.arange(q, device=dev),
    }


def _masked(lg: torch.Tensor, a: int) -> torch.Tensor:
    """``lg`` (rows of positions a, a+1, ...) with -inf past each row's position."""
    pos = a + torch.arange(lg.shape[0], device=lg.device)
    causal = torch.arange(lg.shape[1], device=lg.device)[None, :] <= pos[:, None]
    return lg.masked_fill(~causal, float("-inf"))


def _reference(c: dict[str, Any], a: int, topk: int) -> None:
    """Once per chunk: its rows masked past each position (``torch.topk``'s input), the rows
    past top-k (``live``) and their best scores sorted (``want``)."""
    lg = c["logits"]
    c["masked"] = _masked(lg, a)
    c["live"] = a + torch.arange(lg.shape[0], device=lg.device) + 1 > topk
    c["want"] = c["masked"][c["live"]].topk(topk, dim=-1).values.sort(dim=-1).values


def _exact(c: dict[str, Any], got: torch.Tensor) -> bool:
    """Same multiset of scores as torch.topk over each row's causal keys (rows past top-k)."""
    sel = got[c["live"]]
    if bool((sel < 0).any()):
        return False
    taken = c["logits"][c["live"]].gather(1, sel).sort(dim=-1).values
    return bool(torch.equal(taken, c["want"]))


def _time_ms(fn: Any, dev: torch.device, reps: int, graph: bool = False) -> float:
    """Median ms of ``fn`` (triton's do_bench, ``reps`` ms of calls; ``graph``: one call
    of a CUDA graph of 20, no launch overhead); 0 on the CPU."""
    if dev.type != "cuda":
        fn()
        return 0.0
    import triton

    if not graph:
        return float(triton.testing.do_bench(fn, warmup=5, rep=reps, return_mode="median"))
    g = capture_calls([fn] * 20)
    return float(triton.testing.do_bench(g.replay, warmup=5, rep=reps, return_mode="median")) / 20


def run(dev: torch.device, bw: float | None, reps: int, only: str = "") -> list[dict[str, Any]]:
    from pdserve.kernels.dsa_indexer import SELECT_VARIANTS, topk_select
    from pdserve.kernels.dsa_select import REG_SELECT_HIST, REG_SELECT_MAX_WIDTH, reg_topk_select
    from pdserve.kernels.dsa_select_split import split_topk_select

    cpu = dev.type == "cpu"
    cases, topk = (CPU_CASES, CPU_TOPK) if cpu else (GPU_CASES, GPU_TOPK)
    rows_default = "rows_hist" if REG_SELECT_HIST else "rows_bits"
    g = torch.Generator(device=dev).manual_seed(11)
    rows = []
    for name, chunks in cases.items():
        if not name.startswith(only):
            continue
        inputs = [(a, _chunk(a, b, dev, g, WIDTHS.get(name))) for a, b in chunks]
        for a, c in inputs:
            _reference(c, a, topk)
        nbytes = sum(4 * max(0, p + 1) for a, b in chunks for p in range(a, b) if p + 1 > topk)
        wide = max(WIDTHS.get(name, b) for _, b in chunks) > REG_SELECT_MAX_WIDTH
        graph = name.startswith("decode")
        kernels = [x for x in SELECT_VARIANTS if x not in ("auto", "rows")]
        if graph or cpu:  # few rows: one program's latency, so more warps a row may pay
            kernels += [f"{x}@{w}w" for x in ("rows_bits", "rows_hist") for w in (16, 32)]
            kernels += [f"rows_bits@tail{x}" for x in (4, 16)]
            kernels += [f"split@{x}" for x in (SPLIT_SHAPES_CPU if cpu else SPLIT_SHAPES)]
        for v in [x for x in kernels if not (wide and x.startswith("rows"))] + ["torch.topk"]:
            total, exact, error = 0.0, True, None
            for _, c in inputs:
                q = c["logits"].shape[0]
                try:
                    if v == "torch.topk":  # over rows with -inf past each position
                        fn = partial(torch.topk, c["masked"], topk, dim=-1, sorted=False)
                        total += _time_ms(fn, dev, reps, graph)
                        exact &= _exact(c, fn().indices)
                        continue
                    out = torch.empty(q, topk, dtype=torch.int64, device=dev)
                    args = (c["logits"], c["seq_lens"], c["qsl"], c["req"], c["qidx"], topk, q,
                            out)  # fmt: skip
                    if v.startswith("split@"):
                        fn = partial(split_topk_select, *args, **_split_shape(v))
                    elif "@" in v:  # rows_bits@16w: the register select on 16 warps
                        kind, opts = v.split("@")
                        kw: dict[str, Any] = {"hist": kind == "rows_hist"}
                        for o in opts.split(","):  # rows_bits@tail16: rows past half as two tiles
                            if o.startswith("tail"):
                                kw["tail"] = int(o[4:])
                            else:
                                kw["num_warps"] = int(o.rstrip("w"))
                        fn = partial(reg_topk_select, *args, **kw)
                    else:
                        fn = partial(topk_select, *args, variant=v)
                    total += _time_ms(fn, dev, reps, graph)
                    exact &= _exact(c, out)
                except Exception as e:  # a kernel that does not compile here: its row says so
                    error, exact = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}", False
                    break
            row = {"case": name, "variant": v, "ms": total, "exact": exact,
                   "score_bytes": nbytes,
                   "default": v == ("torch.topk" if wide else rows_default)}  # fmt: skip
            if error:
                row["error"] = error
            if total > 0:
                row["GBps"] = nbytes / (total * 1e-3) / 1e9
                if bw:
                    row["share_of_copy"] = nbytes / (total * 1e-3) / bw
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--reps", type=int, default=50, help="ms of timed calls a point")
    ap.add_argument("--cases", default="", help="only the cases whose name starts so")
    a = ap.parse_args(argv)
    dev = bench_device(a.device)
    if dev is None:
        return 2
    bw = None
    if dev.type == "cuda":
        from gpu_suite import measure_limits

        bw = measure_limits()["copy_bandwidth_Bps"]
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "commit": os.environ.get("PDSERVE_COMMIT", "unknown"),
        "copy_bandwidth_Bps": bw,
    }
    with torch.inference_mode():
        res["select"] = run(dev, bw, a.reps, a.cases)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"\n== select (top-k of the indexer's score rows): ms, GB/s of scores read"
          f"{'' if bw is None else f' (copy {bw / 1e12:.2f} TB/s)'}; * = the default")
    for r in res["select"]:
        gbps = f"{r['GBps']:8.0f}" if "GBps" in r else "       -"
        mark = "*" if r["default"] else " "
        print(f"{r['case']:>20} {r['variant']:>10}{mark} {r['ms']:8.3f} {gbps}"
              f"  exact {r['exact']}  {r.get('error', '')}")  # fmt: skip
    return 0 if all(r["exact"] for r in res["select"]) else 1


if __name__ == "__main__":
    sys.exit(main())
