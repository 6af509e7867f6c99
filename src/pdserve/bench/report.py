"""The printed summary block and the result dict / JSON file of ``vllm bench serve``.

The result dict keeps vLLM's key names and order: settings (``date`` ...
``max_concurrency``), run aggregates, per-request arrays, then ``mean_X_ms``,
``median_X_ms``, ``std_X_ms``, ``pNN_X_ms`` for each selected metric X. The arrays
``input_lens, output_lens, ttfts, itls, start_times, generated_texts, errors``
are dropped unless detailed output is asked; ``latencies`` and ``queue_times``
are always kept.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from pdserve.bench.metrics import BenchmarkMetrics, percentile_label
from pdserve.bench.records import RequestOutput

DETAILED_FIELDS = (
    "input_lens",
    "output_lens",
    "start_times",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
)
_METRIC_TITLES: dict[str, tuple[str, str]] = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": (
        "E2EL incl. Client Queue",
        "Queue-inclusive End-to-end Latency",
    ),
}
_MAX_PRINTED_ERRORS = 10


def _row(label: str, value: object, fmt: str = "") -> str:
    return f"{label:<40} {value:<10{fmt}}"


def format_failures(outputs: Sequence[RequestOutput]) -> str:
    """The first few error strings of failed requests (empty when none failed)."""
    failed = [o for o in outputs if not o.success]
    if not failed:
        return ""
    lines = [f"Failed requests during benchmark run detected (capping to {_MAX_PRINTED_ERRORS}):"]
    lines += [f"Error {i}: {o.error}" for i, o in enumerate(failed[:_MAX_PRINTED_ERRORS])]
    return "\n".join(lines)


def format_summary(
    metrics: BenchmarkMetrics,
    duration_s: float,
    selected_metrics: Sequence[str],
    max_concurrency: int | None,
    request_rate: float,
    goodput_enabled: bool,
) -> str:
    """The result block printed at the end of a run (vLLM's layout and labels)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(_row("Successful requests:", metrics.completed))
    lines.append(_row("Failed requests:", metrics.failed))
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(_row("Request rate configured (RPS):", request_rate, ".2f"))
    lines.append(_row("Benchmark duration (s):", duration_s, ".2f"))
    lines.append(_row("Total input tokens:", metrics.total_input))
    lines.append(_row("Total generated tokens:", metrics.total_output))
    lines.append(_row("Request throughput (req/s):", metrics.request_throughput, ".2f"))
    if goodput_enabled:
        lines.append(_row("Request goodput (req/s):", metrics.request_goodput, ".2f"))
    lines.append(_row("Output token throughput (tok/s):", metrics.output_throughput, ".2f"))
    lines.append(
        _row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s, ".2f")
    )
    lines.append(_row("Peak concurrent requests:", float(metrics.max_concurrent_requests), ".2f"))
    lines.append(_row("Total token throughput (tok/s):", metrics.total_token_throughput, ".2f"))
    for name in _METRIC_TITLES:
        if name not in selected_metrics or name not in metrics.stats:
            continue
        short, header = _METRIC_TITLES[name]
        st = metrics.stats[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_row(f"Mean {short} (ms):", st.mean, ".2f"))
        lines.append(_row(f"Median {short} (ms):", st.median, ".2f"))
        for p, value in st.percentiles:
            lines.append(_row(f"P{percentile_label(p)} {short} (ms):", value, ".2f"))
    lines.append("=" * 50)
    return "\n".join(lines)


def json_number(value: float) -> float | str:
    """JSON-safe float: infinities become ``"inf"``/``"-inf"`` (vLLM writes ``"inf"``)."""
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return float(value)


def build_result(
    settings: Mapping[str, Any],
    metrics: BenchmarkMetrics,
    outputs: Sequence[RequestOutput],
    output_lens: Sequence[int],
    duration_s: float,
    selected_metrics: Sequence[str],
    goodput_enabled: bool,
    detailed: bool,
) -> dict[str, Any]:
    """Settings first, then vLLM's result keys; detailed arrays only when ``detailed``."""
    result: dict[str, Any] = dict(settings)
    result.update(
        {
            "duration": duration_s,
            "completed": metrics.completed,
            "failed": metrics.failed,
            "total_input_tokens": metrics.total_input,
            "total_output_tokens": metrics.total_output,
            "request_throughput": metrics.request_throughput,
            "request_goodput": metrics.request_goodput if goodput_enabled else None,
            "output_throughput": metrics.output_throughput,
            "total_token_throughput": metrics.total_token_throughput,
            "input_lens": [o.prompt_len for o in outputs],
            "output_lens": list(output_lens),
            "ttfts": [o.ttft for o in outputs],
            "itls": [list(o.itl) for o in outputs],
            "latencies": [o.latency for o in outputs],
            "start_times": [o.start_time for o in outputs],
            "queue_times": [o.client_queue_time for o in outputs],
            "generated_texts": [o.generated_text for o in outputs],
            "errors": [o.error for o in outputs],
            "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
            "max_concurrent_requests": metrics.max_concurrent_requests,
        }
    )
    for name in _METRIC_TITLES:
        if name not in selected_metrics or name not in metrics.stats:
            continue
        st = metrics.stats[name]
        result[f"mean_{name}_ms"] = st.mean
        result[f"median_{name}_ms"] = st.median
        result[f"std_{name}_ms"] = st.std
        for p, value in st.percentiles:
            result[f"p{percentile_label(p)}_{name}_ms"] = value
    if not detailed:
        for key in DETAILED_FIELDS:
            result.pop(key, None)
    return result


def default_result_filename(
    label: str | None,
    backend: str,
    request_rate: float,
    max_concurrency: int | None,
    model_id: str,
    date: str,
) -> str:
    """``{label or backend}-{rate}qps[-concurrency{N}]-{model basename}-{date}.json``."""
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    base_model = model_id.rstrip("/").split("/")[-1]
    return f"{label or backend}-{request_rate}qps{conc}-{base_model}-{date}.json"


def result_path(default_name: str, result_filename: str | None, result_dir: str | None) -> Path:
    """Apply ``--result-filename`` / ``--result-dir`` (the directory is created)."""
    name = result_filename or default_name
    if result_dir:
        os.makedirs(result_dir, exist_ok=True)
        return Path(result_dir) / name
    return Path(name)


def save_result(path: Path, result: Mapping[str, Any]) -> None:
    """Write the result dict as one JSON document."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f)


def print_block(text: str, stream: TextIO | None = None) -> None:
    if text:
        print(text, file=stream, flush=True)
