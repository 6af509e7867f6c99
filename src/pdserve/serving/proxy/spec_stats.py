"""Speculative decoding per pool at the proxy: each instance's draft and acceptance
counters, scraped from its ``/metrics`` on a timer and re-exported by the proxy.

The reference deployment drafts at a different depth per pool (1 token on prefill, 3 on
decode) and alerts on the decode pool's MTP acceptance, so the proxy, which knows which
instance is in which pool, is where those numbers are put side by side:

* ``pdserve:proxy_spec_decode_num_drafts_total{pool,instance}``,
  ``..._num_draft_tokens_total`` and ``..._num_accepted_tokens_total``: the instance's
  own ``pdserve:spec_decode_*`` counters (summed over its engines) as of the last scrape.
  They are counters, so ``rate()`` works and an instance restart reads as a reset.
* ``pdserve:proxy_spec_decode_acceptance_rate{pool}`` (accepted / draft tokens) and
  ``pdserve:proxy_spec_decode_mean_acceptance_length{pool}`` (1 + accepted / drafts, as
  vLLM defines it: tokens per verify step) over the pool's instances, lifetime totals.

An instance that runs without speculation reports zeros; one whose ``/metrics`` cannot be
read keeps its last values (a failed scrape is logged at debug level; health is the health
checker's business). Scrapes are bounded by ``timeout`` and never overlap.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.serving.proxy.periodic import Periodic
from pdserve.serving.proxy.pool import InstancePool
from pdserve.serving.proxy.upstream import Upstream

logger = logging.getLogger(__name__)

DEFAULT_SPEC_SCRAPE_INTERVAL_S = 10.0
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_SOURCE = {f"pdserve:spec_decode_{name}_total": name for name in COUNTERS}


def parse_spec_counters(text: str) -> dict[str, float]:
    """The instance's speculative-decoding counters (each summed over its series) from a
    Prometheus text exposition; zeros for counters it does not have."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        if not line.startswith("pdserve:spec_decode_"):
            continue
        key = _SOURCE.get(line.split("{", 1)[0].split(" ", 1)[0])
        if key is None:
            continue
        try:
            out[key] += float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return out


class SpecStats(Collector):
    """The last scraped counters per (pool, instance), exported on the proxy's registry."""

    def __init__(self, instances: Mapping[str, Sequence[str]]) -> None:
        self.values: dict[tuple[str, str], dict[str, float]] = {
            (pool, url): dict.fromkeys(COUNTERS, 0.0)
            for pool, urls in instances.items()
            for url in urls
        }

    def update(self, pool: str, instance: str, counters: Mapping[str, float]) -> None:
        self.values[(pool, instance)] = {k: float(counters.get(k, 0.0)) for k in COUNTERS}

    def pool_summary(self, pool: str) -> tuple[float, float]:
        """(acceptance rate, mean acceptance length) over the pool's instances."""
        tot = dict.fromkeys(COUNTERS, 0.0)
        for (p, _), vals in self.values.items():
            if p == pool:
                for k in COUNTERS:
                    tot[k] += vals[k]
        rate = (
            tot["num_accepted_tokens"] / tot["num_draft_tokens"] if tot["num_draft_tokens"] else 0.0
        )
        length = 1.0 + tot["num_accepted_tokens"] / tot["num_drafts"] if tot["num_drafts"] else 0.0
        return rate, length

    def collect(self) -> Iterator[Metric]:
        for name in COUNTERS:
            fam = CounterMetricFamily(
                f"pdserve:proxy_spec_decode_{name}",
                f"The instance's pdserve:spec_decode_{name} as of the proxy's last scrape.",
                labels=["pool", "instance"],
            )
            for (pool, url), vals in self.values.items():
                fam.add_metric([pool, url], vals[name])
            yield fam
        rate = GaugeMetricFamily(
            "pdserve:proxy_spec_decode_acceptance_rate",
            "Accepted over proposed draft tokens in the pool (lifetime, last scrape).",
            labels=["pool"],
        )
        length = GaugeMetricFamily(
            "pdserve:proxy_spec_decode_mean_acceptance_length",
            "1 + accepted draft tokens per verify step in the pool (0 without drafts).",
            labels=["pool"],
        )
        for pool in sorted({p for p, _ in self.values}):
            r, m = self.pool_summary(pool)
            rate.add_metric([pool], r)
            length.add_metric([pool], m)
        yield rate
        yield length


class SpecScraper(Periodic):
    """Reads every instance's ``/metrics`` each ``interval`` seconds into ``stats``."""

    def __init__(
        self,
        pools: Sequence[InstancePool],
        upstream: Upstream,
        stats: SpecStats,
        headers: Callable[[], dict[str, str]],
        *,
        interval: float = DEFAULT_SPEC_SCRAPE_INTERVAL_S,
        timeout: float = 2.0,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"spec-decode scrape interval must be > 0 seconds, got {interval}")
        self.pools = list(pools)
        self.upstream = upstream
        self.stats = stats
        self.headers = headers
        self.timeout = timeout
        super().__init__("spec-scrape", interval, self.scrape_all)

    async def scrape_all(self) -> None:
        await asyncio.gather(
            *(self._scrape(pool.role, inst.url) for pool in self.pools for inst in pool.instances)
        )

    async def _scrape(self, pool: str, url: str) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                resp = await self.upstream.request(
                    "GET", url + "/metrics", instance=url, headers=self.headers()
                )
                try:
                    text = (await resp.read()).decode("utf-8", "replace")
                    ok = resp.status == 200
                finally:
                    resp.release()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            logger.debug("spec-decode scrape of %s failed: %s", url, e)
            return
        if ok:
            self.stats.update(pool, url, parse_spec_counters(text))
