"""Prometheus series of one API server, named like vLLM's (``pdserve:`` prefix).

Two sources feed the series:

* **Per-request timings** (TTFT, ITL, TPOT, end-to-end latency, token counts, finish
  reasons) are measured in the API server, from the moment the HTTP request arrived,
  through a :class:`RequestMetrics` tracker per request.
* **Engine state** (running/waiting requests, KV-cache usage, and the cumulative
  counters of :class:`~pdserve.core_types.stats.SchedulerStats`) is read from the engine's
  latest stats snapshot at scrape time by a custom collector, so the values are never
  older than the last engine step and nothing has to be pushed.

Every instance owns its own ``CollectorRegistry`` (never the global default), so
several apps can live in one process (tests, multi-instance launchers).

All series carry ``model_name`` and ``engine`` labels. Histogram buckets follow vLLM's
and always include the SLA edges: 20 ms (ITL/TPOT) and 2.5 s (TTFT).

vLLM aliases (``vllm_aliases=True``, ``--metrics-vllm-aliases``): the key series are
exported a second time under vLLM's names (``vllm:`` prefix, :data:`VLLM_ALIASES`, with
``vllm:gpu_cache_usage_perc`` and ``vllm:time_per_output_token_seconds`` for vLLM's
older names), same labels and values, so dashboards built for vLLM read pdserve.

Process RSS: this process is exported as ``pdserve:process_rss_bytes{process="api_server"}``.
Other processes (the engine core, workers) are exported too when the stats snapshot
carries a ``process_rss_bytes: dict[str, int]`` attribute (process name -> bytes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from pdserve.core_types.stats import SchedulerStats, read_rss_bytes

PREFIX = "pdserve:"

# vLLM's TTFT buckets (22); they already include 0.02 and 2.5.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# vLLM's ITL buckets (19) plus the 20 ms TPOT SLA edge.
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's request-latency buckets (21).
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """``[1, 2, 5, 10, 20, 50, ...]`` up to and including ``max_value`` (vLLM's token buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


KV_TRANSFER_TIME_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
KV_TRANSFER_BYTES_BUCKETS = tuple(float(2**k) for k in range(11, 35, 2))  # 2 KiB .. 16 GiB

StatsProvider = Callable[[], SchedulerStats | None]

# pdserve: name (without the prefix) -> the vLLM names it is also exported as
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "request_time_per_output_token_seconds": ("request_time_per_output_token_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "num_preemptions": ("num_preemptions",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
}
VLLM_PREFIX = "vllm:"


def vllm_alias_families(families: Iterable[Metric]) -> list[Metric]:
    """Copies of the families named in :data:`VLLM_ALIASES`, under their vLLM names."""
    out = []
    for fam in families:
        if not fam.name.startswith(PREFIX):
            continue
        base = fam.name[len(PREFIX) :]
        for alias in VLLM_ALIASES.get(base, ()):
            new = VLLM_PREFIX + alias
            copy = Metric(new, fam.documentation, fam.type, fam.unit)
            copy.samples = [s._replace(name=new + s.name[len(fam.name) :]) for s in fam.samples]
            out.append(copy)
    return out


class _Families(Collector):
    """Already collected families, for one exposition."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


class EngineStatsCollector(Collector):
    """Turns the engine's latest :class:`SchedulerStats` into series at scrape time.

    Counters are exported with the cumulative values of the snapshot (the engine keeps
    them monotonic), so a scrape that misses engine steps loses nothing. If the provider
    raises or returns ``None`` the engine series are left out of that scrape; the RSS of
    this process is always exported.
    """

    def __init__(self, stats_provider: StatsProvider, model_name: str, engine: str) -> None:
        self._provider = stats_provider
        self._labels = [model_name, engine]

    def describe(self) -> Iterable[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._provider()
        except Exception:  # a scrape must never fail because the engine is unwell
            stats = None
        return list(self._families(stats))

    def _families(self, stats: SchedulerStats | None) -> Iterator[Metric]:
        base = ["model_name", "engine"]
        gauges = [
            ("num_requests_running", "Requests in the engine's running batch.", "num_running_reqs"),
            ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting_reqs"),
            (
                "num_requests_waiting_for_remote_kv",
                "Requests waiting for KV from a prefill instance.",
                "num_waiting_for_remote_kv",
            ),
            ("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", "kv_cache_usage"),
            (
                "num_requests_kv_held_for_decode",
                "Prefill side: finished requests whose KV is held for a decode instance.",
                "kv_held_for_remote_decode",
            ),
            (
                "kv_transfer_healthy",
                "1 while the KV transfer side channel's threads run, 0 while one is down.",
                "kv_transfer_healthy",
            ),
            (
                "spec_decode_num_drafts_chosen",
                "Drafts per request the latest speculative step verifies (0..k).",
                "spec_last_num_drafts",
            ),
        ]
        for name, doc, attr in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=base)
            if stats is not None:
                g.add_metric(self._labels, float(getattr(stats, attr)))
            yield g
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
            ("num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
            ("engine_steps", "Cumulative number of engine steps.", "num_steps"),
            ("kv_transfer_failures", "Decode side: KV pulls that failed.", "kv_transfer_failures"),
            ("kv_leases_expired", "Prefill side: held KV freed because decode never read it.", "kv_leases_expired"),
            ("kv_transfer_restarts", "KV side-channel threads restarted after they died.", "kv_transfer_restarts"),
            ("spec_decode_num_drafts", "Verify steps of a request with drafts.", "spec_num_drafts"),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", "spec_num_draft_tokens"),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_num_accepted_tokens"),
            ("spec_decode_num_padded_steps", "P/D decode first steps padded to 1+k with placeholder drafts.", "spec_num_padded_steps"),
        ]  # fmt: skip
        for name, doc, attr in counters:
            c = CounterMetricFamily(PREFIX + name, doc, labels=base)
            if stats is not None:
                c.add_metric(self._labels, float(getattr(stats, attr)))
            yield c
        by_source = CounterMetricFamily(
            PREFIX + "prompt_tokens_by_source",
            "Prompt tokens by where their KV came from.",
            labels=[*base, "source"],
        )
        steps = CounterMetricFamily(
            PREFIX + "forward_steps",
            "Engine forward steps by execution path (graph or eager:<reason>).",
            labels=[*base, "path"],
        )
        rejected = CounterMetricFamily(
            PREFIX + "kv_side_channel_rejected",
            "Prefill side: KV side-channel messages refused, by kind "
            "(unauthenticated, malformed, limit).",
            labels=[*base, "kind"],
        )
        by_drafts = CounterMetricFamily(
            PREFIX + "spec_decode_steps_by_num_drafts",
            "Engine steps with running requests by the drafts per request chosen for them.",
            labels=[*base, "num_drafts"],
        )
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = the first).",
            labels=[*base, "position"],
        )
        if stats is not None:
            for pos, n in enumerate(stats.spec_num_accepted_tokens_per_pos):
                per_pos.add_metric([*self._labels, str(pos)], float(n))
            for j, n in enumerate(stats.spec_steps_by_num_drafts):
                by_drafts.add_metric([*self._labels, str(j)], float(n))
            for source, n in sorted(stats.prompt_tokens_by_source.items()):
                by_source.add_metric([*self._labels, source], float(n))
            for path, n in sorted(stats.step_paths.items()):
                steps.add_metric([*self._labels, path], float(n))
            for kind, n in sorted(stats.kv_side_channel_rejected.items()):
                rejected.add_metric([*self._labels, kind], float(n))
        yield by_source
        yield per_pos
        yield by_drafts
        yield steps
        yield rejected
        rss = GaugeMetricFamily(
            PREFIX + "process_rss_bytes",
            "Resident memory of each pdserve process.",
            labels=[*base, "process"],
        )
        own = read_rss_bytes() or None
        if own is not None:
            rss.add_metric([*self._labels, "api_server"], float(own))
        other = getattr(stats, "process_rss_bytes", None) if stats is not None else None
        if isinstance(other, dict):
            for process, nbytes in sorted(other.items()):
                if process != "api_server":
                    rss.add_metric([*self._labels, str(process)], float(nbytes))
        yield rss


class PrometheusMetrics:
    """All series of one API server, in a registry of its own.

    Lifecycle: build once per app; call :meth:`start_request` when a generation request
    arrives and drive the returned tracker; :meth:`render` produces the text exposition.
    """

    def __init__(
        self,
        model_name: str,
        *,
        stats_provider: StatsProvider,
        max_model_len: int,
        engine: str = "0",
        vllm_aliases: bool = False,
    ) -> None:
        self.registry = CollectorRegistry()
        self.vllm_aliases = vllm_aliases
        self.model_name = model_name
        labels = {"model_name": model_name, "engine": engine}
        names = list(labels)
        reg = self.registry

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, names, registry=reg, buckets=buckets)

        token_buckets = build_1_2_5_buckets(max(1, max_model_len))
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prefilled prompt tokens.", names, registry=reg
        ).labels(**labels)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", names, registry=reg
        ).labels(**labels)
        success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            [*names, "finished_reason"],
            registry=reg,
        )
        self._success = {r: success.labels(**labels, finished_reason=r) for r in FINISH_REASONS}
        self._success_family = success
        self._labels = labels
        self.ttft = hist(
            "time_to_first_token_seconds", "Time to first token from arrival.", TTFT_BUCKETS
        ).labels(**labels)
        self.itl = hist(
            "inter_token_latency_seconds", "Gap between consecutive outputs.", ITL_BUCKETS
        ).labels(**labels)
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Per-request mean time per output token after the first.",
            ITL_BUCKETS,
        ).labels(**labels)
        self.e2e = hist(
            "e2e_request_latency_seconds", "Request latency from arrival.", REQUEST_LATENCY_BUCKETS
        ).labels(**labels)
        self.request_prompt_tokens = hist(
            "request_prompt_tokens", "Prompt length of finished requests.", token_buckets
        ).labels(**labels)
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Generated tokens of finished requests.", token_buckets
        ).labels(**labels)
        self.kv_transfer_time = hist(
            "kv_transfer_time_seconds",
            "Decode side: time to pull one request's KV.",
            KV_TRANSFER_TIME_BUCKETS,
        ).labels(**labels)
        self.kv_transfer_bytes = hist(
            "kv_transfer_bytes",
            "Decode side: bytes pulled for one request.",
            KV_TRANSFER_BYTES_BUCKETS,
        ).labels(**labels)
        reg.register(EngineStatsCollector(stats_provider, model_name, engine))

    def observe_stats(self, stats: SchedulerStats) -> None:
        """Record the per-snapshot samples (each snapshot carries only its own step's)."""
        for t in stats.kv_transfer_seconds:
            self.kv_transfer_time.observe(t)
        for n in stats.kv_transfer_bytes:
            self.kv_transfer_bytes.observe(n)

    def start_request(self, arrival_time: float, prompt_tokens: int) -> RequestMetrics:
        """A tracker for one request; ``arrival_time`` is on the ``time.monotonic`` clock."""
        return RequestMetrics(self, arrival_time, prompt_tokens)

    def count_finished(self, finish_reason: str) -> None:
        child = self._success.get(finish_reason)
        if child is None:
            child = self._success_family.labels(**self._labels, finished_reason=finish_reason)
            self._success[finish_reason] = child
        child.inc()

    def render(self) -> tuple[bytes, str]:
        """``(body, content_type)`` of the Prometheus text exposition."""
        if not self.vllm_aliases:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        families = list(self.registry.collect())  # one read of the engine's stats
        body = generate_latest(_Families(families + vllm_alias_families(families)))
        return body, CONTENT_TYPE_LATEST


class RequestMetrics:
    """Timings of one request. Call :meth:`on_output` per delta output, then :meth:`finish`
    exactly once (later calls are ignored). Not thread-safe: one event loop owns it."""

    __slots__ = (
        "_m", "_arrival", "_prompt_tokens", "_first", "_last", "_generated", "_finished",
    )  # fmt: skip

    def __init__(self, metrics: PrometheusMetrics, arrival_time: float, prompt_tokens: int) -> None:
        self._m = metrics
        self._arrival = arrival_time
        self._prompt_tokens = prompt_tokens
        self._first: float | None = None
        self._last: float | None = None
        self._generated = 0
        self._finished = False

    @property
    def num_generated(self) -> int:
        return self._generated

    def on_output(self, num_new_tokens: int, now: float | None = None) -> None:
        """One delta output with ``num_new_tokens`` tokens (outputs without tokens are ignored)."""
        if self._finished or num_new_tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        if self._first is None:
            self._first = now
            self._m.ttft.observe(max(0.0, now - self._arrival))
            self._m.prompt_tokens.inc(self._prompt_tokens)
        elif self._last is not None:
            self._m.itl.observe(max(0.0, now - self._last))
        self._last = now
        self._generated += num_new_tokens
        self._m.generation_tokens.inc(num_new_tokens)

    def discard(self) -> None:
        """Record nothing more for this request (it was rejected before it ran)."""
        self._finished = True

    def finish(self, finish_reason: str, now: float | None = None) -> None:
        if self._finished:
            return
        self._finished = True
        now = time.monotonic() if now is None else now
        m = self._m
        m.count_finished(finish_reason)
        end = self._last if self._last is not None else now
        m.e2e.observe(max(0.0, end - self._arrival))
        m.request_prompt_tokens.observe(self._prompt_tokens)
        m.request_generation_tokens.observe(self._generated)
        if self._first is not None and self._last is not None and self._generated > 1:
            m.tpot.observe(max(0.0, (self._last - self._first) / (self._generated - 1)))
