"""Reading a server's Prometheus ``/metrics`` from the benchmark client.

Three users:

* ``bench serve`` scrapes the prefix-cache counters before and after a run and reports
  the run's hit rate (``prefix_cache_hit_rate`` = delta hits / delta queries, in tokens);
* ``bench sla`` gets the same per point (it runs ``bench serve``);
* ``soak`` samples ``process_rss_bytes``, ``kv_cache_usage_perc`` and
  ``num_requests_running`` of every instance while it drives load.

Series are read under the ``pdserve:`` prefix, else under ``vllm:``, so the numbers
come from a vLLM server too. A counter is the sum of its samples over all label values
(all engines of a data-parallel instance, all instances named). A URL that does not
answer, or has no such series (a P/D proxy keeps no prefix cache), yields ``None`` with
the reason, never an exception: scraping must not fail a benchmark.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

PREFIXES = ("pdserve:", "vllm:")
_TIMEOUT = aiohttp.ClientTimeout(total=10)


@dataclass(frozen=True)
class Sample:
    """One exposition line: ``name{labels} value``."""

    name: str
    labels: dict[str, str]
    value: float


def _parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        eq = text.find("=", i)
        if eq < 0:
            break
        key = text[i:eq].strip().lstrip(",").strip()
        j = eq + 1
        if j >= n or text[j] != '"':
            break
        j += 1
        chars: list[str] = []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                nxt = text[j + 1]
                chars.append("\n" if nxt == "n" else nxt)
                j += 2
                continue
            chars.append(text[j])
            j += 1
        labels[key] = "".join(chars)
        i = j + 1
    return labels


def parse_exposition(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (comments and malformed lines skipped)."""
    out: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        if brace >= 0:
            close = line.rfind("}")
            if close < brace:
                continue
            name, labels, rest = (
                line[:brace],
                _parse_labels(line[brace + 1 : close]),
                line[close + 1 :],
            )
        else:
            name, _, rest = line.partition(" ")
            labels = {}
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out.append(Sample(name, labels, value))
    return out


def find(samples: Sequence[Sample], name: str) -> list[Sample]:
    """Samples of series ``name`` (without prefix; ``_total`` optional) under the first
    prefix of ``PREFIXES`` that has any (a server exporting ``vllm:`` aliases of its
    ``pdserve:`` series is not counted twice)."""
    for prefix in PREFIXES:
        names = {prefix + name, prefix + name + "_total"}
        found = [s for s in samples if s.name in names]
        if found:
            return found
    return []


def total(samples: Sequence[Sample], name: str) -> float | None:
    """Sum of series ``name`` over all its label values; ``None`` when it is absent."""
    found = find(samples, name)
    return sum(s.value for s in found) if found else None


def metrics_url(base_or_metrics: str) -> str:
    """``http://h:p`` -> ``http://h:p/metrics``; a URL already ending in /metrics is kept."""
    url = base_or_metrics.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


async def scrape(session: aiohttp.ClientSession, url: str) -> list[Sample]:
    """GET ``url`` and parse it; raises ``aiohttp.ClientError``/``TimeoutError``/``ValueError``."""
    async with session.get(url, timeout=_TIMEOUT) as resp:
        if resp.status != 200:
            raise ValueError(f"GET {url} -> HTTP {resp.status}")
        return parse_exposition(await resp.text(errors="replace"))


async def scrape_all(urls: Sequence[str]) -> dict[str, list[Sample] | str]:
    """``{url: samples}`` for every URL, or ``{url: "reason"}`` where the scrape failed."""
    async with aiohttp.ClientSession(trust_env=False) as session:
        results = await asyncio.gather(*(scrape(session, u) for u in urls), return_exceptions=True)
    out: dict[str, list[Sample] | str] = {}
    for url, res in zip(urls, results, strict=True):
        if isinstance(res, BaseException):
            out[url] = f"{type(res).__name__}: {res}".strip()
        else:
            out[url] = res
    return out


# -- prefix cache -------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixCacheCounters:
    """Summed ``prefix_cache_queries`` / ``prefix_cache_hits`` of the named instances, or
    ``None`` with ``reason`` when any instance could not give them."""

    queries: float | None
    hits: float | None
    reason: str = ""


async def read_prefix_cache(urls: Sequence[str]) -> PrefixCacheCounters:
    if not urls:
        return PrefixCacheCounters(None, None, "no metrics URL")
    got = await scrape_all(urls)
    queries = hits = 0.0
    for url, res in got.items():
        if isinstance(res, str):
            return PrefixCacheCounters(None, None, f"{url}: {res}")
        q, h = total(res, "prefix_cache_queries"), total(res, "prefix_cache_hits")
        if q is None or h is None:
            return PrefixCacheCounters(
                None,
                None,
                f"{url} exports no prefix_cache_queries/hits (a P/D proxy keeps no prefix "
                "cache: pass --metrics-url once per instance)",
            )
        queries += q
        hits += h
    return PrefixCacheCounters(queries, hits)


def prefix_cache_result(before: PrefixCacheCounters, after: PrefixCacheCounters) -> dict[str, Any]:
    """The result-dict keys: ``prefix_cache_hit_rate`` (0..1 or ``None``), the raw
    ``prefix_cache_hits`` / ``prefix_cache_queries`` deltas, and the reason for a ``None``."""
    reason = before.reason or after.reason
    out: dict[str, Any] = {
        "prefix_cache_hit_rate": None,
        "prefix_cache_hits": None,
        "prefix_cache_queries": None,
        "prefix_cache_note": reason or None,
    }
    if reason or before.queries is None or after.queries is None:
        return out
    assert before.hits is not None and after.hits is not None
    dq, dh = after.queries - before.queries, after.hits - before.hits
    if dq < 0 or dh < 0:
        out["prefix_cache_note"] = "counters went backwards (server restarted during the run?)"
        return out
    out["prefix_cache_hits"] = int(dh) if float(dh).is_integer() else dh
    out["prefix_cache_queries"] = int(dq) if float(dq).is_integer() else dq
    if dq == 0:
        out["prefix_cache_note"] = "no prompt tokens were looked up during the run"
        return out
    out["prefix_cache_hit_rate"] = dh / dq
    return out


def format_prefix_cache(result: dict[str, Any]) -> str:
    """One summary line (two with the reason of a missing rate)."""
    rate = result.get("prefix_cache_hit_rate")
    label = f"{'Prefix cache hit rate:':<40} "
    if rate is None or (isinstance(rate, float) and math.isnan(rate)):
        return f"{label}{'n/a':<10}\n  ({result.get('prefix_cache_note') or 'unknown'})"
    return (
        f"{label}{100 * rate:<10.2f}% ({result['prefix_cache_hits']} of "
        f"{result['prefix_cache_queries']} prompt tokens)"
    )
