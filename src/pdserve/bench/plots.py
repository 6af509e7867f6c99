"""PNG plots of ``bench sla`` and ``soak``. matplotlib is imported here, on first use,
with the non-interactive Agg backend, so ``pdserve`` start-up never loads it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sla(
    endpoints: Sequence[dict[str, Any]],
    *,
    x_label: str,
    sla_ttft_ms: float,
    sla_tpot_ms: float,
    metric: str,
    prefix: Path,
) -> list[Path]:
    """``{prefix}-latency.png`` (TTFT and TPOT against load, SLA lines dashed) and
    ``{prefix}-throughput.png`` (output tok/s and goodput against load), one line per
    endpoint. ``endpoints``: the ``bench sla`` JSON's ``endpoints`` entries."""
    plt = _pyplot()
    paths = [Path(f"{prefix}-latency.png"), Path(f"{prefix}-throughput.png")]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, name, limit in ((axes[0], "ttft", sla_ttft_ms), (axes[1], "tpot", sla_tpot_ms)):
        for ep in endpoints:
            pts = sorted(ep["points"], key=lambda p: p["x"])
            ax.plot(
                [p["x"] for p in pts],
                [p.get(f"{metric}_{name}_ms") or 0.0 for p in pts],
                marker="o",
                label=ep["label"],
            )
            if ep.get("capacity") is not None:
                ax.axvline(ep["capacity"], color="grey", linestyle=":", linewidth=1)
        ax.axhline(limit, color="red", linestyle="--", label=f"SLA {limit:g} ms")
        ax.set_xlabel(x_label)
        ax.set_ylabel(f"{metric} {name.upper()} (ms)")
        ax.set_title(f"{name.upper()} against load")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ep in endpoints:
        pts = sorted(ep["points"], key=lambda p: p["x"])
        xs = [p["x"] for p in pts]
        axes[0].plot(
            xs, [p.get("output_throughput") or 0.0 for p in pts], marker="o", label=ep["label"]
        )
        axes[1].plot(
            xs,
            [p.get("request_throughput") or 0.0 for p in pts],
            marker="o",
            label=f"{ep['label']} throughput",
        )
        axes[1].plot(
            xs,
            [p.get("request_goodput") or 0.0 for p in pts],
            marker="x",
            linestyle="--",
            label=f"{ep['label']} goodput",
        )
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("requests/s")
    for ax in axes:
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("Output throughput against load")
    axes[1].set_title("Request throughput and goodput")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths


def plot_soak(
    series: dict[str, tuple[list[float], list[float]]],
    fits: dict[str, tuple[float, float]],
    gauges: dict[str, tuple[list[float], list[float], list[float]]],
    path: Path,
) -> Path:
    """Left: RSS (MiB) against completed requests per process, with the fitted line
    (``fits[key] = (slope bytes/request, intercept bytes)``). Right: KV usage (%) and
    running requests against time per instance (``gauges[url] = (t, kv, running)``)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for key, (xs, ys) in sorted(series.items()):
        (line,) = ax.plot(xs, [y / 2**20 for y in ys], marker=".", linestyle="", label=key)
        if key in fits and xs:
            slope, icpt = fits[key]
            lo, hi = min(xs), max(xs)
            ax.plot(
                [lo, hi],
                [(icpt + slope * lo) / 2**20, (icpt + slope * hi) / 2**20],
                color=line.get_color(),
            )
    ax.set_xlabel("completed requests")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("Process RSS against completed requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1]
    twin = ax.twinx()
    for url, (ts, kv, running) in sorted(gauges.items()):
        ax.plot(ts, [100 * v for v in kv], label=f"{url} KV %")
        twin.plot(ts, running, linestyle="--", label=f"{url} running")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV cache usage (%)")
    twin.set_ylabel("running requests")
    ax.set_title("KV usage and running requests")
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
