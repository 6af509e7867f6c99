"""``pdserve bench sla``: the largest load at which a server meets an SLA.

Usage::

    pdserve bench sla --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --random-input-len 1024 --random-output-len 128 \\
        --sla-ttft-ms 2500 --sla-tpot-ms 20 [--sla-metric mean|p50|p90|p99] \\
        [--search rate|concurrency] [--start 1] [--tolerance 0.1] [--num-gpus 2] \\
        [--compare URL1 URL2 ... --compare-labels A B ...]

Every point is one full ``bench serve`` run (same flags; its functions, not a copy),
with ``--num-warmups`` warm-up requests (default 8 here) and a fresh seed, so the prompts
of one point never hit the prefix cache of an earlier one. ``--search rate`` varies the
Poisson request rate (``--burstiness`` and ``--max-concurrency`` still apply);
``--search concurrency`` varies ``--max-concurrency`` (``--request-rate``, default inf,
still applies). A point passes when no request failed, the chosen statistic of TTFT
and of TPOT is within the SLA and (at a finite rate) the server completed requests at
no less than 95% of the rate they arrived at (``achieved_request_rate`` against
``offered_request_rate``, :func:`pdserve.bench.metrics.sustained_rates`): a server that
falls behind builds a queue, which a short run may not show in its latencies yet. A
rate point sends ``--num-prompts`` (default 200) or ``rate x --min-point-seconds``
(default 10 s) requests, whichever is more, so every point runs long enough for that
queue to show and for its rates to be measured (at 150 req/s, 200 prompts last 1.3 s:
two searches of one CPU server found 160 and 104 req/s; with 10 s points, 144 and 144).
The search (``sla_search``) doubles from ``--start`` to bracket the capacity and bisects
to ``--tolerance`` (relative).

Output: ``sla-<search>-<date>.json`` in ``--result-dir`` (or ``--result-filename``) with
every point (load, pass/fail and why, latency statistics, throughput, goodput, prefix
cache hit rate), the capacity, goodput and output tokens/s per GPU at capacity, and two
PNGs beside it (``-latency.png``: TTFT and TPOT against load with the SLA lines;
``-throughput.png``). With ``--compare`` the same search runs against each URL in turn
and a table compares them. Exit status: 0 when every endpoint has a capacity, 1 when one
missed the SLA even at ``--min-load``, 2 on bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import sys
from datetime import datetime
from typing import Any

from tqdm import tqdm

from pdserve.bench import serve
from pdserve.bench.errors import BenchError
from pdserve.bench.report import result_path
from pdserve.bench.sla_search import SLA, SLA_METRICS, Point, SearchResult, max_points, search

DEFAULT_WARMUPS = 8
DEFAULT_PROMPTS = 200
DEFAULT_MIN_POINT_SECONDS = 10.0
_SUMMARY_KEYS = (
    "request_rate", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "max_concurrent_requests",
    "prefix_cache_hit_rate", "prefix_cache_hits", "prefix_cache_queries",
    "offered_request_rate", "achieved_request_rate",
)  # fmt: skip


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``bench serve``'s flags plus the search's."""
    serve.add_cli_args(parser)
    parser.set_defaults(num_warmups=DEFAULT_WARMUPS, num_prompts=DEFAULT_PROMPTS)
    g = parser.add_argument_group("SLA search")
    g.add_argument("--sla-ttft-ms", type=float, default=2500.0, help="TTFT limit (ms).")
    g.add_argument("--sla-tpot-ms", type=float, default=20.0, help="TPOT limit (ms).")
    g.add_argument("--sla-metric", choices=SLA_METRICS, default="mean")
    g.add_argument(
        "--search",
        choices=("rate", "concurrency"),
        default="rate",
        help="Vary the Poisson request rate, or the maximum concurrency.",
    )
    g.add_argument("--start", type=float, default=None, help="First load (default 1).")
    g.add_argument(
        "--max-load", type=float, default=None, help="Stop doubling here (default 1024)."
    )
    g.add_argument(
        "--min-load",
        type=float,
        default=None,
        help="Stop halving here (default start/64 for rates, 1 for concurrency).",
    )
    g.add_argument("--tolerance", type=float, default=0.1, help="Relative width to bisect to.")
    g.add_argument(
        "--min-point-seconds",
        type=float,
        default=DEFAULT_MIN_POINT_SECONDS,
        help="A rate point sends at least rate x this many seconds of requests (more than "
        "--num-prompts when the rate is high), so every point lasts long enough for a "
        "queue to show (0: --num-prompts alone).",
    )
    g.add_argument(
        "--num-gpus",
        type=int,
        nargs="+",
        default=[1],
        help="GPUs behind the endpoint (one value, or one per --compare URL).",
    )
    g.add_argument("--compare", nargs="+", default=None, metavar="URL", help="Search each URL.")
    g.add_argument("--compare-labels", nargs="+", default=None, metavar="LABEL")
    g.add_argument("--no-plot", action="store_true", help="Write no PNG.")
    g.add_argument("--show-points", action="store_true", help="Print each point's full summary.")


def default_args(**overrides: Any) -> argparse.Namespace:
    """This command's CLI defaults with ``overrides`` (by ``dest``); unknown names raise."""
    return serve.defaults_with(add_cli_args, "bench sla", overrides)


def _bounds(args: argparse.Namespace) -> tuple[float, float, float]:
    integer = args.search == "concurrency"
    start = float(args.start if args.start is not None else 1.0)
    max_load = float(args.max_load if args.max_load is not None else 1024.0)
    min_load = args.min_load
    if min_load is None:
        min_load = 1.0 if integer else start / 64
    if integer:
        start, max_load, min_load = (
            float(round(start)),
            float(round(max_load)),
            float(round(min_load)),
        )
    if not (0 < min_load <= start <= max_load) or (integer and min_load < 1):
        raise BenchError(
            f"need 0 < --min-load ({min_load:g}) <= --start ({start:g}) <= --max-load "
            f"({max_load:g}){' and concurrency >= 1' if integer else ''}"
        )
    return start, max_load, float(min_load)


def _endpoints(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """``(label, base_url, num_gpus)`` of every endpoint to search."""
    if args.compare:
        urls = [u.rstrip("/") for u in args.compare]
        labels = args.compare_labels or urls
        if len(labels) != len(urls):
            raise BenchError(f"--compare-labels needs {len(urls)} labels, got {len(labels)}")
    else:
        if args.compare_labels:
            raise BenchError("--compare-labels needs --compare")
        base, _ = serve._urls(args)
        urls, labels = [base], [args.label or base]
    gpus = list(args.num_gpus)
    if len(gpus) == 1:
        gpus *= len(urls)
    if len(gpus) != len(urls) or any(g < 1 for g in gpus):
        raise BenchError(f"--num-gpus needs one value >= 1 or one per endpoint ({len(urls)})")
    return list(zip(labels, urls, gpus, strict=True))


def _check(args: argparse.Namespace) -> None:
    if not args.tolerance > 0:
        raise BenchError(f"--tolerance must be > 0, got {args.tolerance}")
    if not args.min_point_seconds >= 0:
        raise BenchError(f"--min-point-seconds must be >= 0, got {args.min_point_seconds}")
    if args.search == "rate" and not math.isinf(args.request_rate):
        raise BenchError("--search rate varies the request rate: give --start, not --request-rate")
    if args.search == "concurrency" and args.max_concurrency is not None:
        raise BenchError("--search concurrency varies it: give --start, not --max-concurrency")
    for name in ("sla_ttft_ms", "sla_tpot_ms"):
        if not getattr(args, name) > 0:
            raise BenchError(f"--{name.replace('_', '-')} must be > 0")


def _point_args(
    args: argparse.Namespace, sla: SLA, url: str, label: str, x: float, k: int, own_metrics: bool
) -> argparse.Namespace:
    p = argparse.Namespace(**vars(args))
    p.base_url = url
    p.label = label
    if args.search == "rate":
        p.request_rate = x
        p.num_prompts = max(args.num_prompts, math.ceil(x * args.min_point_seconds))
    else:
        p.max_concurrency = int(x)
    p.seed = args.seed + k  # fresh prompts: no prefix-cache hit on an earlier point's
    p.request_id_prefix = f"{args.request_id_prefix}p{k}-"
    p.save_result = False
    p.save_detailed = False
    p.disable_tqdm = True
    p.percentile_metrics = "ttft,tpot,itl,e2el"
    p.metric_percentiles = "50,90,99"
    p.goodput = [f"ttft:{sla.ttft_ms}", f"tpot:{sla.tpot_ms}"]
    if not own_metrics:
        p.metrics_url = None
    return p


def _summary(result: dict[str, Any], num_gpus: int) -> dict[str, Any]:
    out = {k: result.get(k) for k in _SUMMARY_KEYS}
    for key, value in result.items():
        if key.endswith("_ms") and not isinstance(value, list):
            out[key] = value
    out["output_throughput_per_gpu"] = float(result.get("output_throughput") or 0.0) / num_gpus
    return out


def _point_line(label: str, what: str, p: Point, metric: str) -> str:
    s = p.summary
    mark = "PASS" if p.passed else "FAIL"
    return (
        f"[{label}] {what}={p.x:g}: {mark} {metric} TTFT {s.get(f'{metric}_ttft_ms') or 0:.1f} ms, "
        f"{metric} TPOT {s.get(f'{metric}_tpot_ms') or 0:.2f} ms, "
        f"{s.get('request_throughput') or 0:.2f} req/s, {s.get('output_throughput') or 0:.1f} "
        f"tok/s ({p.why})"
    )


async def search_endpoint(
    args: argparse.Namespace, sla: SLA, label: str, url: str, num_gpus: int, own_metrics: bool
) -> SearchResult:
    """Run the capacity search against one endpoint."""
    start, max_load, min_load = _bounds(args)
    what = "rate" if args.search == "rate" else "concurrency"
    total = max_points(start, args.tolerance, max_load, min_load)
    bar = tqdm(total=total, desc=f"SLA search {label}", unit="point", disable=args.disable_tqdm)
    count = [0]

    async def measure(x: float) -> Point:
        pargs = _point_args(args, sla, url, label, x, count[0], own_metrics)
        count[0] += 1
        sink: contextlib.AbstractContextManager[Any] = (
            contextlib.nullcontext()
            if args.show_points
            else contextlib.redirect_stdout(io.StringIO())
        )
        with sink:
            result = await serve.benchmark_from_args(pargs)
        passed, why = sla.check(result)
        return Point(x=x, passed=passed, why=why, summary=_summary(result, num_gpus))

    def on_point(p: Point) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{what}={p.x:g} {'pass' if p.passed else 'fail'}")
        tqdm.write(_point_line(label, what, p, sla.metric))

    try:
        return await search(
            measure,
            start=start,
            tolerance=args.tolerance,
            max_value=max_load,
            min_value=min_load,
            integer=args.search == "concurrency",
            on_point=on_point,
        )
    finally:
        bar.total = bar.n
        bar.close()


def endpoint_record(label: str, url: str, num_gpus: int, res: SearchResult) -> dict[str, Any]:
    """One entry of the JSON's ``endpoints`` list."""
    cap = res.capacity_point()
    at_cap = None
    if cap is not None:
        keys = ("request_throughput", "request_goodput", "output_throughput",
                "output_throughput_per_gpu", "mean_ttft_ms", "mean_tpot_ms")  # fmt: skip
        at_cap = {k: cap.summary.get(k) for k in keys}
    return {
        "label": label,
        "base_url": url,
        "num_gpus": num_gpus,
        "capacity": res.capacity,
        "bounded_by_max_load": res.bounded,
        "bracket": list(res.bracket),
        "at_capacity": at_cap,
        "points": [{"x": p.x, "passed": p.passed, "why": p.why, **p.summary} for p in res.points],
    }


def format_table(endpoints: list[dict[str, Any]], search_kind: str) -> str:
    """The comparison table (one row per endpoint)."""
    cap_head = "capacity req/s" if search_kind == "rate" else "capacity conc."
    head = (f"{'endpoint':<28} {cap_head:>14} {'req/s':>8} {'mean TTFT ms':>13} "
            f"{'mean TPOT ms':>13} {'out tok/s':>10} {'tok/s/GPU':>10} {'goodput':>8}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for ep in endpoints:
        a = ep["at_capacity"]
        if a is None:
            lines.append(f"{ep['label'][:28]:<28} {'SLA missed':>14}")
            continue
        cap = f"{ep['capacity']:g}" + ("+" if ep["bounded_by_max_load"] else "")
        lines.append(
            f"{ep['label'][:28]:<28} {cap:>14} "
            f"{a['request_throughput'] or 0:>8.2f} {a['mean_ttft_ms'] or 0:>13.1f} "
            f"{a['mean_tpot_ms'] or 0:>13.2f} {a['output_throughput'] or 0:>10.1f} "
            f"{a['output_throughput_per_gpu'] or 0:>10.1f} {a['request_goodput'] or 0:>8.2f}"
        )
    return "\n".join(lines)


async def run_sla_async(args: argparse.Namespace) -> dict[str, Any]:
    """Search every endpoint, print the table, write the JSON (and PNGs); return the JSON."""
    _check(args)
    serve.parse_goodput(args.goodput)  # bench serve's own checks, before any traffic
    sla = SLA(args.sla_ttft_ms, args.sla_tpot_ms, args.sla_metric)
    endpoints = _endpoints(args)
    start, max_load, min_load = _bounds(args)
    records = []
    for label, url, gpus in endpoints:
        res = await search_endpoint(args, sla, label, url, gpus, own_metrics=len(endpoints) == 1)
        records.append(endpoint_record(label, url, gpus, res))
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    out: dict[str, Any] = {
        "date": date,
        "search": args.search,
        "sla": {"ttft_ms": sla.ttft_ms, "tpot_ms": sla.tpot_ms, "metric": sla.metric},
        "tolerance": args.tolerance,
        "start": start,
        "max_load": max_load,
        "min_load": min_load,
        "num_prompts": args.num_prompts,
        "num_warmups": args.num_warmups,
        "input_len": args.input_len if args.input_len is not None else args.random_input_len,
        "output_len": args.output_len if args.output_len is not None else args.random_output_len,
        "endpoints": records,
    }
    print(format_table(records, args.search), flush=True)
    path = result_path(f"sla-{args.search}-{date}.json", args.result_filename, args.result_dir)
    if not args.no_plot:
        from pdserve.bench.plots import plot_sla

        x_label = "request rate (req/s)" if args.search == "rate" else "max concurrency"
        plots = plot_sla(
            records, x_label=x_label, sla_ttft_ms=sla.ttft_ms, sla_tpot_ms=sla.tpot_ms,
            metric=sla.metric, prefix=path.with_suffix(""),
        )  # fmt: skip
        out["plots"] = [str(p) for p in plots]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(f"Saved SLA search to {path}", flush=True)
    return out


def main(args: argparse.Namespace) -> int:
    """CLI body; exit status as in the module docstring."""
    try:
        out = asyncio.run(run_sla_async(args))
    except BenchError as exc:
        print(f"pdserve bench sla: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pdserve bench sla: interrupted", file=sys.stderr)
        return 130
    return 0 if all(ep["capacity"] is not None for ep in out["endpoints"]) else 1
