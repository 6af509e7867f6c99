"""``pdserve soak``: drive an endpoint at a fixed rate and judge every process's memory.

Usage::

    pdserve soak --base-url http://127.0.0.1:8000 --request-rate 50 \\
        (--num-requests 20000 | --duration-min 30) \\
        [--metrics-url http://p:8100 --metrics-url http://d:8200 ...] \\
        [--random-input-len 128 --random-output-len 16] [--sample-interval-s 2] \\
        [--warmup-requests 50] [--leak-threshold-kb-per-1k 64] [--result-dir DIR]

The load is ``bench serve``'s: random-dataset prompts, the same arrival schedule and
streaming request functions (``runner.run_requests``). First ``--warmup-requests`` are
sent and not measured (caches, pools and lazily built objects settle); then, every
``--sample-interval-s`` and once before and after the run, each ``--metrics-url``
(default: the server's own ``/metrics``; name every instance behind a proxy, and the
proxy itself) is scraped for ``process_rss_bytes`` of every process, KV-cache usage and
running/waiting requests (:mod:`.soak_sampler`).

For each process RSS is fitted against the number of completed requests
(:mod:`.soak_fit`): an overall line, a warm-up that flattens (its growth, MiB) apart
from a steady slope, and the slope of the run's second half, each with a 95 %
confidence interval. The verdict is **LEAK** only when the steady slope and the second
half's slope both lie wholly above ``--leak-threshold-kb-per-1k`` KiB per 1,000
requests: growth that persists, not a warm-up. Output:
a table per process, ``soak-<date>.csv`` (every sample), ``soak-<date>.png`` (RSS against
requests with the fitted lines; KV usage and running requests against time) and
``soak-<date>.json`` (the verdicts). Exit status: 0 when no process leaks, 1 when one
does, 2 on bad input or when no URL exports ``process_rss_bytes``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from pdserve.bench import serve
from pdserve.bench.datasets import sample_random_requests
from pdserve.bench.endpoint import get_first_model
from pdserve.bench.errors import BenchError
from pdserve.bench.records import RequestOutput
from pdserve.bench.request_func import BACKENDS, check_endpoint
from pdserve.bench.runner import RunSpec, run_requests
from pdserve.bench.scrape import metrics_url
from pdserve.bench.soak_fit import (
    fit_slope,
    fit_tail,
    fit_warmup,
    kb_per_1k,
    leak_verdict,
    threshold_bytes_per_request,
)
from pdserve.bench.soak_sampler import SoakSamples, take_sample
from pdserve.bench.tokenizer import load_tokenizer


def _pos_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _pos_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_neg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    srv = parser.add_argument_group("server")
    srv.add_argument("--backend", choices=BACKENDS, default="openai")
    srv.add_argument("--base-url", default=None, help="Overrides --host/--port.")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--endpoint", default=None)
    srv.add_argument("--model", default=None, help="Default: the first of GET /v1/models.")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--tokenizer", default=None, help="Local tokenizer folder; default --model.")
    srv.add_argument("--api-key", default=None, help="Default $OPENAI_API_KEY.")
    srv.add_argument(
        "--metrics-url",
        action="append",
        default=None,
        metavar="URL",
        help="An instance (or proxy) to sample; repeatable. Default: the server itself.",
    )
    srv.add_argument("--request-id-prefix", default=f"soak-{uuid.uuid4().hex[:8]}-")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=_pos_float, default=20.0, help="Requests/s.")
    load.add_argument("--burstiness", type=_pos_float, default=1.0)
    load.add_argument("--max-concurrency", type=_pos_int, default=None)
    load.add_argument("--num-requests", type=_pos_int, default=None)
    load.add_argument("--duration-min", type=_pos_float, default=None)
    load.add_argument("--warmup-requests", type=_non_neg_int, default=50)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--random-input-len", type=_non_neg_int, default=128)
    load.add_argument("--random-output-len", type=_non_neg_int, default=16)
    load.add_argument("--random-range-ratio", type=float, default=0.0)
    load.add_argument("--random-prefix-len", type=_non_neg_int, default=0)
    load.add_argument("--temperature", type=float, default=None)
    load.add_argument("--top-p", type=float, default=None)
    load.add_argument("--top-k", type=int, default=None)
    judge = parser.add_argument_group("sampling and verdict")
    judge.add_argument("--sample-interval-s", type=_pos_float, default=2.0)
    judge.add_argument(
        "--leak-threshold-kb-per-1k",
        type=float,
        default=64.0,
        help="Growth (KiB per 1,000 requests) a process may show before it is a leak.",
    )
    judge.add_argument("--result-dir", default=None)
    judge.add_argument("--no-plot", action="store_true")
    judge.add_argument("--disable-tqdm", action="store_true")


def default_args(**overrides: Any) -> argparse.Namespace:
    """The CLI defaults with ``overrides`` (by ``dest``); unknown names raise."""
    return serve.defaults_with(add_cli_args, "soak", overrides)


def _num_requests(args: argparse.Namespace) -> int:
    if (args.num_requests is None) == (args.duration_min is None):
        raise BenchError("give exactly one of --num-requests and --duration-min")
    if args.num_requests is not None:
        return int(args.num_requests)
    return max(1, math.ceil(args.request_rate * args.duration_min * 60))


def judge(samples: SoakSamples, threshold_kb_per_1k: float) -> list[dict[str, Any]]:
    """One verdict record per process series (see :mod:`.soak_fit`)."""
    limit = threshold_bytes_per_request(threshold_kb_per_1k)
    out = []
    for key, (xs, ys) in sorted(samples.rss_series().items()):
        fit = fit_slope(xs, ys)
        warm = fit_warmup(xs, ys)
        tail = fit_tail(xs, ys)
        out.append(
            {
                "process": key,
                "samples": fit.n,
                "rss_first_bytes": ys[0],
                "rss_last_bytes": ys[-1],
                # the overall line
                "slope_bytes_per_request": fit.slope,
                "intercept_bytes": fit.intercept,
                "slope_kb_per_1k": kb_per_1k(fit.slope),
                "ci95_low_kb_per_1k": kb_per_1k(fit.ci_low),
                "ci95_high_kb_per_1k": kb_per_1k(fit.ci_high),
                # warm-up (growth that flattens) apart from the steady slope
                "warmup_mib": warm.warmup / 2**20,
                "warmup_ci95_low_mib": warm.warmup_ci_low / 2**20,
                "warmup_ci95_high_mib": warm.warmup_ci_high / 2**20,
                "warmup_tau_requests": warm.tau,
                "steady_slope_kb_per_1k": kb_per_1k(warm.slope),
                "steady_ci95_low_kb_per_1k": kb_per_1k(warm.slope_ci_low),
                "steady_ci95_high_kb_per_1k": kb_per_1k(warm.slope_ci_high),
                # the second half of the run
                "tail_slope_kb_per_1k": kb_per_1k(tail.slope),
                "tail_ci95_low_kb_per_1k": kb_per_1k(tail.ci_low),
                "tail_ci95_high_kb_per_1k": kb_per_1k(tail.ci_high),
                "verdict": leak_verdict(warm, tail, limit),
            }
        )
    return out


def _ci(r: dict[str, Any], key: str, low: str, high: str) -> str:
    return f"{r[key]:.1f} [{r[low]:.1f}, {r[high]:.1f}]"


def format_verdicts(records: list[dict[str, Any]], threshold_kb_per_1k: float) -> str:
    head = (
        f"{'process':<40} {'n':>4} {'RSS MiB':>14} {'overall KiB/1k':>24} "
        f"{'warm-up MiB':>22} {'steady KiB/1k':>24} {'2nd half KiB/1k':>24}  verdict"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        rss = f"{r['rss_first_bytes'] / 2**20:.1f}->{r['rss_last_bytes'] / 2**20:.1f}"
        overall = _ci(r, "slope_kb_per_1k", "ci95_low_kb_per_1k", "ci95_high_kb_per_1k")
        warm = _ci(r, "warmup_mib", "warmup_ci95_low_mib", "warmup_ci95_high_mib")
        steady = _ci(
            r, "steady_slope_kb_per_1k", "steady_ci95_low_kb_per_1k", "steady_ci95_high_kb_per_1k"
        )
        tail = _ci(r, "tail_slope_kb_per_1k", "tail_ci95_low_kb_per_1k", "tail_ci95_high_kb_per_1k")
        lines.append(
            f"{r['process'][-40:]:<40} {r['samples']:>4} {rss:>14} {overall:>24} {warm:>22} "
            f"{steady:>24} {tail:>24}  {r['verdict'].upper()}"
        )
    lines.append(
        "(values [95% CI]; leak: the steady slope's and the second half's whole CIs above "
        f"{threshold_kb_per_1k:g} KiB per 1,000 requests; a warm-up that flattens is not one)"
    )
    return "\n".join(lines)


async def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, drive the load while sampling, judge, write CSV/PNG/JSON; return the JSON."""
    n = _num_requests(args)
    base_url, api_url = serve._urls(args)
    try:
        check_endpoint(args.backend, api_url)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    if args.leak_threshold_kb_per_1k < 0:
        raise BenchError("--leak-threshold-kb-per-1k must be >= 0")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if args.model is None:
        model_name, model_id = await get_first_model(base_url, headers)
    else:
        model_id, model_name = args.model, args.served_model_name or args.model
    tokenizer = load_tokenizer(args.tokenizer or model_id)
    reqs = sample_random_requests(
        tokenizer,
        num_requests=n + args.warmup_requests,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        prefix_len=args.random_prefix_len,
        seed=args.seed,
        request_id_prefix=args.request_id_prefix,
    )
    urls = [metrics_url(u) for u in (args.metrics_url or [base_url])]

    def spec(requests: Any, **extra: Any) -> RunSpec:
        return RunSpec(
            backend=args.backend, api_url=api_url, model=model_name, requests=requests,
            request_rate=args.request_rate, burstiness=args.burstiness, seed=args.seed,
            max_concurrency=args.max_concurrency, ignore_eos=True,
            extra_body=serve._sampling_params(args), headers=headers, **extra,
        )  # fmt: skip

    if args.warmup_requests:
        print(f"Soak warm-up: {args.warmup_requests} requests (not measured)", flush=True)
        await run_requests(spec(reqs[: args.warmup_requests], disable_tqdm=True))
    counts = {"completed": 0, "failed": 0}

    def on_complete(out: RequestOutput) -> None:
        counts["completed"] += 1
        counts["failed"] += 0 if out.success else 1

    samples = SoakSamples()
    t0 = time.monotonic()
    await take_sample(urls, lambda: counts["completed"], t0, samples)
    main = spec(
        reqs[args.warmup_requests :], disable_tqdm=args.disable_tqdm, on_complete=on_complete
    )
    task = asyncio.create_task(run_requests(main))
    while True:
        finished, _ = await asyncio.wait({task}, timeout=args.sample_interval_s)
        if finished:
            break
        await take_sample(urls, lambda: counts["completed"], t0, samples)
    outcome = await task
    await take_sample(urls, lambda: counts["completed"], t0, samples)
    return _report(args, samples, counts, n, outcome.duration_s)


def _report(
    args: argparse.Namespace,
    samples: SoakSamples,
    counts: dict[str, int],
    n: int,
    duration_s: float,
) -> dict[str, Any]:
    for err in samples.errors[:10]:
        print(f"soak: scrape failed at {err}", file=sys.stderr)
    records = judge(samples, args.leak_threshold_kb_per_1k)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = Path(args.result_dir or ".")
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"soak-{date}"
    csv_path = stem.with_suffix(".csv")
    samples.write_csv(csv_path)
    result: dict[str, Any] = {
        "date": date,
        "request_rate": args.request_rate,
        "num_requests": n,
        "warmup_requests": args.warmup_requests,
        "completed": counts["completed"],
        "failed": counts["failed"],
        "duration_s": duration_s,
        "leak_threshold_kb_per_1k": args.leak_threshold_kb_per_1k,
        "processes": records,
        "scrape_errors": samples.errors,
        "csv": str(csv_path),
    }
    if not args.no_plot and records:
        from pdserve.bench.plots import plot_soak

        fits = {r["process"]: (r["slope_bytes_per_request"], r["intercept_bytes"]) for r in records}
        fits = {k: v for k, v in fits.items() if not math.isnan(v[0])}
        png = plot_soak(samples.rss_series(), fits, samples.gauges(), stem.with_suffix(".png"))
        result["plot"] = str(png)
    with open(stem.with_suffix(".json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=str)
    print(
        f"Soak: {counts['completed']} requests ({counts['failed']} failed) in "
        f"{duration_s:.1f} s, {len(samples.rows)} instance samples",
        flush=True,
    )
    print(format_verdicts(records, args.leak_threshold_kb_per_1k), flush=True)
    print(f"Saved {csv_path}" + (f" and {result['plot']}" if "plot" in result else ""), flush=True)
    return result


def main(args: argparse.Namespace) -> int:
    """CLI body; exit status as in the module docstring."""
    try:
        result = asyncio.run(run_soak(args))
    except BenchError as exc:
        print(f"pdserve soak: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pdserve soak: interrupted", file=sys.stderr)
        return 130
    if not result["processes"]:
        print("pdserve soak: no --metrics-url exports process_rss_bytes", file=sys.stderr)
        return 2
    leaks = [r["process"] for r in result["processes"] if r["verdict"] == "leak"]
    if leaks:
        print(f"pdserve soak: LEAK in {', '.join(leaks)}", file=sys.stderr)
        return 1
    return 0
