"""``pdserve bench serve``: an open-loop HTTP load generator with ``vllm bench serve``'s
flags and metric definitions (TTFT, TPOT, ITL and E2EL computed as vLLM computes them).

Entry points:

* ``add_cli_args(parser)`` / ``main(args) -> int`` for the CLI;
* ``run_benchmark(**flags)`` / ``await run_benchmark_async(**flags)`` for programs
  and tests: keyword names are the CLI flags' ``dest`` names (``num_prompts=...``),
  missing ones take the CLI defaults; returns the same dict ``--save-result`` writes;
* ``await benchmark_from_args(args)`` for an already-parsed namespace.

Only flags that are implemented exist; argparse refuses the rest of vLLM's.

Beyond vLLM: every result carries the run's prefix-cache hit rate
(``prefix_cache_hit_rate``, ``prefix_cache_hits``, ``prefix_cache_queries`` in prompt
tokens), from the ``/metrics`` counters scraped after the warm-ups and after the run;
``--metrics-url`` (repeatable) names the instances to scrape (default: the server
itself; a P/D proxy has no prefix cache, so name its instances). Without counters the
rate is ``null`` and ``prefix_cache_note`` says why.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from pdserve.bench.datasets import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_PREFIX_LEN,
    DEFAULT_RANGE_RATIO,
    SUPPORTED_DATASETS,
    sample_random_requests,
)
from pdserve.bench.endpoint import get_first_model, wait_until_ready
from pdserve.bench.errors import BenchError
from pdserve.bench.metrics import (
    GOODPUT_METRICS,
    PERCENTILE_METRICS,
    calculate_metrics,
    sustained_rates,
)
from pdserve.bench.report import (
    build_result,
    default_result_filename,
    format_failures,
    format_summary,
    json_number,
    print_block,
    result_path,
    save_result,
)
from pdserve.bench.request_func import BACKENDS, DEFAULT_ENDPOINTS, check_endpoint
from pdserve.bench.runner import RunSpec, run_requests
from pdserve.bench.scrape import (
    PrefixCacheCounters,
    format_prefix_cache,
    metrics_url,
    prefix_cache_result,
    read_prefix_cache,
)
from pdserve.bench.tokenizer import load_tokenizer
from pdserve.heap import freeze_startup_heap

DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf allowed), got {text}")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Register ``pdserve bench serve``'s flags (vLLM's names and defaults)."""
    srv = parser.add_argument_group("server")
    srv.add_argument(
        "--backend",
        choices=BACKENDS,
        default="openai",
        help="API flavour: 'openai' (completions) or 'openai-chat' (chat completions).",
    )
    srv.add_argument(
        "--base-url",
        default=None,
        help="Server base URL (e.g. http://10.0.0.1:8000); overrides --host/--port.",
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--endpoint",
        default=None,
        help="API path; default /v1/completions (openai) or /v1/chat/completions (openai-chat).",
    )
    srv.add_argument(
        "--model",
        default=None,
        help="Model name sent in requests; if absent, the first model of GET /v1/models.",
    )
    srv.add_argument(
        "--served-model-name",
        default=None,
        help="Name to put in requests when it differs from --model (--model then only "
        "names the tokenizer and the result).",
    )
    srv.add_argument(
        "--tokenizer",
        default=None,
        help="Local HF model folder (or tokenizer.json) of the tokenizer; defaults to "
        "--model. Hub ids are only found in the local HF cache.",
    )
    srv.add_argument(
        "--api-key",
        default=None,
        help="Sent as 'Authorization: Bearer ...'; defaults to $OPENAI_API_KEY.",
    )
    srv.add_argument(
        "--ready-check-timeout-sec",
        type=_non_negative_int,
        default=0,
        help="Poll /health or /v1/models until the server answers, up to this many "
        "seconds; 0 skips the check.",
    )
    srv.add_argument(
        "--metrics-url",
        action="append",
        default=None,
        metavar="URL",
        help="Prometheus endpoint to read prefix-cache counters from (repeatable, one per "
        "instance; summed); default: the server's own /metrics.",
    )
    srv.add_argument(
        "--request-id-prefix",
        default=f"bench-{uuid.uuid4().hex[:8]}-",
        help="Prefix of the x-request-id header (request i gets prefix + i).",
    )

    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        choices=SUPPORTED_DATASETS,
        default="random",
        help="Only vLLM's 'random' dataset is implemented (sharegpt, sonnet, hf, "
        "custom, ... are not).",
    )
    data.add_argument("--num-prompts", type=_positive_int, default=1000)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", type=_non_negative_int, default=DEFAULT_INPUT_LEN)
    data.add_argument("--random-output-len", type=_non_negative_int, default=DEFAULT_OUTPUT_LEN)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=DEFAULT_RANGE_RATIO,
        help="Lengths are uniform in [L(1-r), L(1+r)]; r in [0, 1).",
    )
    data.add_argument("--random-prefix-len", type=_non_negative_int, default=DEFAULT_PREFIX_LEN)
    data.add_argument(
        "--input-len",
        type=_non_negative_int,
        default=None,
        help="Alias that overrides --random-input-len.",
    )
    data.add_argument(
        "--output-len",
        type=_non_negative_int,
        default=None,
        help="Alias that overrides --random-output-len.",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=_positive_float,
        default=float("inf"),
        help="Requests/s; inf sends all at t=0, otherwise gamma-distributed gaps.",
    )
    load.add_argument(
        "--burstiness",
        type=_positive_float,
        default=1.0,
        help="Gamma shape: 1 = Poisson, <1 burstier, >1 smoother, inf = constant gaps.",
    )
    load.add_argument("--max-concurrency", type=_positive_int, default=None)
    load.add_argument("--num-warmups", type=_non_negative_int, default=0)

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Send ignore_eos (always on for the random dataset, as in vLLM).",
    )
    sampling.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="Default 0 unless --top-p/--top-k is given.",
    )
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)

    out = parser.add_argument_group("results")
    out.add_argument(
        "--percentile-metrics",
        default=None,
        help=f"Comma list of {', '.join(PERCENTILE_METRICS)}; default "
        f"'{DEFAULT_PERCENTILE_METRICS}'.",
    )
    out.add_argument("--metric-percentiles", default="99", help="Comma list, e.g. '50,90,99'.")
    out.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:VALUE",
        help="SLOs in ms, e.g. 'ttft:2500 tpot:20'; keys ttft, tpot, e2el.",
    )
    out.add_argument("--save-result", action="store_true")
    out.add_argument(
        "--save-detailed",
        action="store_true",
        help="Keep per-request arrays (input_lens, ttfts, itls, texts, errors, ...).",
    )
    out.add_argument("--result-dir", default=None)
    out.add_argument("--result-filename", default=None)
    out.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE")
    out.add_argument("--label", default=None, help="Result label; defaults to --backend.")
    out.add_argument("--disable-tqdm", action="store_true")


def defaults_with(
    add_args: Callable[[argparse.ArgumentParser], None], what: str, overrides: dict[str, Any]
) -> argparse.Namespace:
    """The defaults of the flags ``add_args`` defines, with ``overrides`` (by ``dest``
    name) applied; an unknown name raises ``TypeError`` naming ``what``."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        if not hasattr(args, key):
            raise TypeError(f"unknown {what} option {key!r}")
        setattr(args, key, value)
    return args


def default_args(**overrides: Any) -> argparse.Namespace:
    """CLI defaults with ``overrides`` (by ``dest`` name) applied; unknown names raise."""
    return defaults_with(add_cli_args, "benchmark", overrides)


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:2500", "tpot:20"] -> {"ttft": 2500.0, "tpot": 20.0}`` (validated, ms)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, raw = pair.partition(":")
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not sep or math.isnan(value):
            raise BenchError(f"--goodput entries must be KEY:VALUE (ms), got {pair!r}")
        if name not in GOODPUT_METRICS:
            raise BenchError(f"--goodput key {name!r} must be one of {list(GOODPUT_METRICS)}")
        if value < 0:
            raise BenchError(f"--goodput value for {name} must be >= 0, got {value}")
        slos[name] = value
    return slos


def parse_percentile_metrics(text: str | None) -> list[str]:
    names = [n.strip() for n in (text or DEFAULT_PERCENTILE_METRICS).split(",") if n.strip()]
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise BenchError(f"--percentile-metrics: unknown {bad}; allowed {list(PERCENTILE_METRICS)}")
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError as exc:
        raise BenchError(f"--metric-percentiles must be numbers, got {text!r}") from exc
    if not values or any(not 0 <= p <= 100 for p in values):
        raise BenchError(f"--metric-percentiles must be in [0, 100], got {text!r}")
    return values


def parse_metadata(items: list[str] | None) -> dict[str, str]:
    meta: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BenchError(f"--metadata entries must be KEY=VALUE, got {item!r}")
        meta[key.strip()] = value.strip()
    return meta


def _sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    params = {
        k: v
        for k, v in (
            ("temperature", args.temperature),
            ("top_p", args.top_p),
            ("top_k", args.top_k),
        )
        if v is not None
    }
    if not params:
        params["temperature"] = 0.0
    return params


def _urls(args: argparse.Namespace) -> tuple[str, str]:
    """``(base_url, api_url)``."""
    if args.base_url:
        base = str(args.base_url).rstrip("/")
    else:
        host = f"[{args.host}]" if ":" in str(args.host) else str(args.host)
        base = f"http://{host}:{args.port}"
    endpoint = args.endpoint or DEFAULT_ENDPOINTS[args.backend]
    if not endpoint.startswith("/"):
        raise BenchError(f"--endpoint must start with '/', got {endpoint!r}")
    return base, base + endpoint


def _check_args(args: argparse.Namespace) -> None:
    if args.backend not in BACKENDS:
        raise BenchError(f"--backend must be one of {list(BACKENDS)}, got {args.backend!r}")
    if args.dataset_name not in SUPPORTED_DATASETS:
        raise BenchError(
            f"--dataset-name {args.dataset_name!r} is not implemented; only "
            f"{list(SUPPORTED_DATASETS)} is supported"
        )
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise BenchError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0 or not args.burstiness > 0:
        raise BenchError("--request-rate and --burstiness must be > 0")


async def benchmark_from_args(args: argparse.Namespace, freeze_gc: bool = False) -> dict[str, Any]:
    """Run one benchmark described by parsed flags; print the summary; return the result dict.
    (The flags themselves are not printed: the result file records the settings.)"""
    _check_args(args)
    selected_metrics = parse_percentile_metrics(args.percentile_metrics)
    percentiles = parse_metric_percentiles(args.metric_percentiles)
    goodput = parse_goodput(args.goodput)
    metadata = parse_metadata(args.metadata)
    base_url, api_url = _urls(args)
    try:
        check_endpoint(args.backend, api_url)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    if args.ready_check_timeout_sec > 0:
        print(f"Waiting up to {args.ready_check_timeout_sec} s for {base_url}...", flush=True)
        await wait_until_ready(base_url, headers, args.ready_check_timeout_sec)
        print("Server is ready.", flush=True)
    else:
        print("Skipping endpoint ready check.", flush=True)

    if args.model is None:
        print("Model not specified, fetching first model from server...", flush=True)
        model_name, model_id = await get_first_model(base_url, headers)
        print(f"First model name: {model_name}, first model id: {model_id}", flush=True)
    else:
        model_id = args.model
        model_name = args.served_model_name or args.model
    tokenizer_id = args.tokenizer or model_id
    tokenizer = load_tokenizer(tokenizer_id)

    input_len = args.input_len if args.input_len is not None else args.random_input_len
    output_len = args.output_len if args.output_len is not None else args.random_output_len
    requests = sample_random_requests(
        tokenizer,
        num_requests=args.num_prompts,
        input_len=input_len,
        output_len=output_len,
        range_ratio=args.random_range_ratio,
        prefix_len=args.random_prefix_len,
        seed=args.seed,
        request_id_prefix=args.request_id_prefix or "",
    )
    if freeze_gc:  # the prompts live for the whole run; keep them out of GC passes
        freeze_startup_heap()

    scrape_urls = [metrics_url(u) for u in (args.metrics_url or [base_url])]
    cache_before = PrefixCacheCounters(None, None, "not read")

    async def read_before() -> None:  # after the warm-ups: they do not count
        nonlocal cache_before
        cache_before = await read_prefix_cache(scrape_urls)

    spec = RunSpec(
        backend=args.backend,
        api_url=api_url,
        model=model_name,
        requests=requests,
        request_rate=float(args.request_rate),
        burstiness=float(args.burstiness),
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        ignore_eos=True,  # forced for the random dataset, as vLLM does
        extra_body=_sampling_params(args),
        headers=headers,
        num_warmups=args.num_warmups,
        disable_tqdm=args.disable_tqdm,
        before_main=read_before,
    )
    outcome = await run_requests(spec)
    cache = prefix_cache_result(cache_before, await read_prefix_cache(scrape_urls))

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    metrics, output_lens = calculate_metrics(
        outcome.outputs,
        outcome.duration_s,
        percentiles,
        goodput_slos_ms=goodput,
        count_tokens=count_tokens,
        max_concurrency=args.max_concurrency,
        request_rate=spec.request_rate,
    )
    print_block(format_failures(outcome.outputs))
    print_block(
        format_summary(
            metrics,
            outcome.duration_s,
            selected_metrics,
            args.max_concurrency,
            spec.request_rate,
            goodput_enabled=bool(goodput),
        )
    )
    print_block(format_prefix_cache(cache))

    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    settings: dict[str, Any] = {
        "date": date,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
        **metadata,
        "request_rate": json_number(spec.request_rate),
        "burstiness": json_number(spec.burstiness),
        "max_concurrency": args.max_concurrency,
    }
    result = build_result(
        settings,
        metrics,
        outcome.outputs,
        output_lens,
        outcome.duration_s,
        selected_metrics,
        goodput_enabled=bool(goodput),
        detailed=bool(args.save_detailed),
    )
    result.update(cache)
    result.update(sustained_rates(outcome.outputs, spec.request_rate))
    if args.save_result:
        name = default_result_filename(
            args.label, args.backend, spec.request_rate, args.max_concurrency, model_id, date
        )
        path = result_path(name, args.result_filename, args.result_dir)
        save_result(path, result)
        print(f"Saved result to {path}", flush=True)
    return result


async def run_benchmark_async(**flags: Any) -> dict[str, Any]:
    """``benchmark_from_args(default_args(**flags))``."""
    return await benchmark_from_args(default_args(**flags))


def run_benchmark(**flags: Any) -> dict[str, Any]:
    """Blocking form of ``run_benchmark_async``; must not be called from a running loop."""
    return asyncio.run(run_benchmark_async(**flags))


def main(args: argparse.Namespace) -> int:
    """CLI body: 0 when at least one request succeeded, 1 when all failed, 2 on bad input."""
    try:
        result = asyncio.run(benchmark_from_args(args, freeze_gc=True))
    except BenchError as exc:
        print(f"pdserve bench serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pdserve bench serve: interrupted", file=sys.stderr)
        return 130
    if not result.get("completed"):
        print("pdserve bench serve: every request failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__)
    add_cli_args(_parser)
    sys.exit(main(_parser.parse_args()))
