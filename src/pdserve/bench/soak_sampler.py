"""What ``soak`` samples from each ``--metrics-url`` while it drives load.

Every sample is one scrape of every URL at one moment, tagged with the number of
requests the client had completed by then. Per URL it keeps every process's RSS
(``process_rss_bytes``, by ``process`` label and, for a data-parallel instance, by
``engine``), the KV-cache usage (mean over engines), and running and waiting requests
(summed over engines). A URL that fails to answer is recorded as an error for that
sample, and the run goes on.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.scrape import Sample, find, scrape_all, total

CSV_FIELDS = (
    "time_s", "completed", "metrics_url", "process", "rss_bytes",
    "kv_cache_usage_perc", "num_requests_running", "num_requests_waiting",
)  # fmt: skip


@dataclass(frozen=True)
class InstanceSample:
    """One URL at one moment. ``rss`` maps a process key to bytes."""

    url: str
    rss: dict[str, float]
    kv_usage: float | None
    running: float | None
    waiting: float | None


@dataclass
class SoakSamples:
    """Everything sampled during a run, in time order."""

    rows: list[tuple[float, int, InstanceSample]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def rss_series(self) -> dict[str, tuple[list[float], list[float]]]:
        """``{"<url> <process>": (completed, rss bytes)}``."""
        out: dict[str, tuple[list[float], list[float]]] = {}
        for _, done, inst in self.rows:
            for proc, value in inst.rss.items():
                xs, ys = out.setdefault(f"{inst.url} {proc}", ([], []))
                xs.append(float(done))
                ys.append(value)
        return out

    def gauges(self) -> dict[str, tuple[list[float], list[float], list[float]]]:
        """``{url: (time s, kv usage 0..1, running)}``."""
        out: dict[str, tuple[list[float], list[float], list[float]]] = {}
        for t, _, inst in self.rows:
            ts, kv, run = out.setdefault(inst.url, ([], [], []))
            ts.append(t)
            kv.append(inst.kv_usage or 0.0)
            run.append(inst.running or 0.0)
        return out

    def write_csv(self, path: Path) -> None:
        """One row per (sample, URL, process); gauges repeat on each process's row."""
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(CSV_FIELDS)
            for t, done, inst in self.rows:
                procs: list[tuple[str, float | None]] = [*sorted(inst.rss.items())] or [("", None)]
                for proc, rss in procs:
                    w.writerow(
                        [f"{t:.3f}", done, inst.url, proc, "" if rss is None else int(rss),
                         _cell(inst.kv_usage), _cell(inst.running), _cell(inst.waiting)]
                    )  # fmt: skip


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:g}"


def _process_key(s: Sample) -> str:
    proc = s.labels.get("process", "?")
    engine = s.labels.get("engine", "")
    return proc if engine in ("", "0") else f"{proc}[engine={engine}]"


def instance_sample(url: str, samples: Sequence[Sample]) -> InstanceSample:
    rss = {_process_key(s): s.value for s in find(samples, "process_rss_bytes")}
    kv = find(samples, "kv_cache_usage_perc")
    return InstanceSample(
        url=url,
        rss=rss,
        kv_usage=sum(s.value for s in kv) / len(kv) if kv else None,
        running=total(samples, "num_requests_running"),
        waiting=total(samples, "num_requests_waiting"),
    )


async def take_sample(
    urls: Sequence[str], completed: Callable[[], int], t0: float, into: SoakSamples
) -> None:
    """Scrape every URL once and append the results to ``into``."""
    done_before = completed()
    got = await scrape_all(urls)
    now = time.monotonic() - t0
    # the count taken before the scrape: RSS read a moment later can only be higher
    for url, res in got.items():
        if isinstance(res, str):
            into.errors.append(f"{now:.1f}s {url}: {res}")
            continue
        into.rows.append((now, done_before, instance_sample(url, res)))
