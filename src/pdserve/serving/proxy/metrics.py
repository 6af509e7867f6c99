"""Prometheus series of the P/D proxy (``pdserve:proxy_*``), in a registry of its own.

Label conventions:

* per-instance series carry ``pool`` (``"prefill"``, ``"decode"`` or ``"colocated"``)
  and ``instance`` (the instance's base URL);
* the latency histograms carry ``pool`` = the deployment's pool name (``"pdserve"`` by
  default: one proxy fronts one pool) plus ``decode_instance`` (TTFT, TPOT: the
  instance that generated the tokens, a decode or a colocated one) or
  ``prefill_instance`` (prefill leg), so dashboards can show the pool overall (sum over
  instances) or one instance.

TTFT is measured from the request's arrival at the proxy to the first streamed data
chunk that carries tokens (``choices``, or a Responses API text delta; streaming) or to
the full response (non-streaming).
TPOT per streaming request is ``(last chunk - first chunk) / (chunks - 1)`` over the
data chunks that carry ``choices``; requests with fewer than two such chunks (and
non-streaming requests) add no TPOT sample. Buckets include the SLA edges, 20 ms and
2.5 s.

Every series of a known instance exists from the start (zero-valued), so dashboards and
alerts see them before the first request.

Like every pdserve process, the proxy exports its resident memory as
``pdserve:process_rss_bytes{process="proxy"}`` (read at scrape time; ``pdserve soak``
samples it).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.core_types.stats import read_rss_bytes
from pdserve.metrics.prometheus import ITL_BUCKETS, PREFIX, TTFT_BUCKETS

POOLS: tuple[str, ...] = ("prefill", "decode", "colocated")

# Request outcomes per leg (label ``outcome`` of ``pdserve:proxy_requests_total``).
OUTCOMES: tuple[str, ...] = (
    "success",  # 2xx, and for a stream: ended normally
    "client_error",  # upstream 4xx
    "server_error",  # upstream 5xx
    "connection_error",  # could not connect, or the connection broke
    "timeout",  # no (further) answer within the request timeout
    "bad_response",  # 200 whose body is not what the protocol says
    "client_disconnect",  # the client went away while this leg ran
    "instance_down",  # the instance was marked down while this leg ran
)

# Why the proxy asked a prefill instance to release a request's KV.
RELEASE_REASONS: tuple[str, ...] = (
    "client_disconnect",  # the client went away after the prefill leg returned
    "decode_connection_error",  # the decode leg could not connect, timed out or broke
    "decode_error",  # the decode instance answered an error status
    "decode_instance_down",  # the decode instance was marked down during the leg
    "no_decode_instance",  # no healthy decode instance was left after the prefill leg
    "proxy_error",  # the proxy itself failed unexpectedly
)


class ProxyMetrics:
    """All proxy series. Build once per app with the instance URLs of every pool: prefill
    and decode (P/D), or colocated.

    Methods take the instance URL; an unknown URL raises ``KeyError`` from the label
    caches, which would be a programming error (instances are fixed at build time).
    """

    def __init__(
        self,
        prefill_urls: Iterable[str] = (),
        decode_urls: Iterable[str] = (),
        *,
        colocated_urls: Iterable[str] = (),
        pool_name: str = "pdserve",
    ) -> None:
        self.registry = CollectorRegistry()
        self.pool_name = pool_name
        self._health_state: dict[tuple[str, str], bool] = {}
        reg = self.registry
        urls = {
            "prefill": list(prefill_urls),
            "decode": list(decode_urls),
            "colocated": list(colocated_urls),
        }

        self._requests = Counter(
            PREFIX + "proxy_requests",
            "Legs sent by the proxy, by pool, instance and outcome.",
            ["pool", "instance", "outcome"],
            registry=reg,
        )
        self._retries = Counter(
            PREFIX + "proxy_retries",
            "Legs retried on another instance after a failure.",
            ["pool"],
            registry=reg,
        )
        self._unavailable = Counter(
            PREFIX + "proxy_no_healthy_instance",
            "Requests answered 503 because a pool had no healthy instance.",
            ["pool"],
            registry=reg,
        )
        self._stale = Counter(
            PREFIX + "proxy_stale_connection_retries",
            "Requests re-sent on a new connection because the pooled one was closed "
            "by the instance before any answer.",
            ["pool"],
            registry=reg,
        )
        self._marked_down = Counter(
            PREFIX + "proxy_instance_marked_down",
            "Times an instance went from healthy to unhealthy.",
            ["pool", "instance"],
            registry=reg,
        )
        self._missing_kv = Counter(
            PREFIX + "proxy_prefill_missing_kv_params",
            "Prefill legs that returned 200 without kv_transfer_params "
            "(decode then recomputes the whole prompt).",
            ["prefill_instance"],
            registry=reg,
        )
        self._released = Counter(
            PREFIX + "proxy_kv_released",
            "Release calls sent to a prefill instance for KV its request no longer needs.",
            ["prefill_instance", "reason"],
            registry=reg,
        )
        self._in_flight = Gauge(
            PREFIX + "proxy_in_flight_requests",
            "Legs in flight through this proxy, per instance.",
            ["pool", "instance"],
            registry=reg,
        )
        self._healthy = Gauge(
            PREFIX + "proxy_instance_healthy",
            "1 if the instance is considered healthy, else 0.",
            ["pool", "instance"],
            registry=reg,
        )
        self._ttft = Histogram(
            PREFIX + "proxy_time_to_first_token_seconds",
            "Time from arrival at the proxy to the first token chunk (or full response).",
            ["pool", "decode_instance"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self._tpot = Histogram(
            PREFIX + "proxy_time_per_output_token_seconds",
            "Mean time between streamed token chunks of one request.",
            ["pool", "decode_instance"],
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self._prefill_leg = Histogram(
            PREFIX + "proxy_prefill_leg_seconds",
            "Duration of successful prefill legs (request sent to JSON received).",
            ["pool", "prefill_instance"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        Gauge(
            PREFIX + "process_rss_bytes",
            "Resident memory of each pdserve process.",
            ["process"],
            registry=reg,
        ).labels("proxy").set_function(read_rss_bytes)
        for pool, pool_urls in urls.items():
            if not pool_urls:
                continue
            for url in pool_urls:
                self._in_flight.labels(pool, url).set(0)
                self._healthy.labels(pool, url).set(0)
                self._marked_down.labels(pool, url)
                for outcome in OUTCOMES:
                    self._requests.labels(pool, url, outcome)
            self._retries.labels(pool)
            self._unavailable.labels(pool)
            self._stale.labels(pool)
        for url in urls["prefill"]:
            self._missing_kv.labels(url)
            self._prefill_leg.labels(pool_name, url)
            for reason in RELEASE_REASONS:
                self._released.labels(url, reason)
        for url in urls["decode"] + urls["colocated"]:  # the instances that generate
            self._ttft.labels(pool_name, url)
            self._tpot.labels(pool_name, url)

    # -- counters -----------------------------------------------------------------
    def leg_done(self, pool: str, instance: str, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        self._requests.labels(pool, instance, outcome).inc()

    def retried(self, pool: str) -> None:
        self._retries.labels(pool).inc()

    def unavailable(self, pool: str) -> None:
        self._unavailable.labels(pool).inc()

    def stale_connection_retry(self, pool: str) -> None:
        self._stale.labels(pool).inc()

    def missing_kv_params(self, prefill_instance: str) -> None:
        self._missing_kv.labels(prefill_instance).inc()

    def kv_released(self, prefill_instance: str, reason: str) -> None:
        if reason not in RELEASE_REASONS:
            raise ValueError(f"unknown release reason {reason!r}")
        self._released.labels(prefill_instance, reason).inc()

    # -- gauges -------------------------------------------------------------------
    def set_in_flight(self, pool: str, instance: str, value: int) -> None:
        self._in_flight.labels(pool, instance).set(value)

    def set_healthy(self, pool: str, instance: str, healthy: bool) -> None:
        was = self._health_state.get((pool, instance), False)
        self._health_state[(pool, instance)] = healthy
        if was and not healthy:
            self._marked_down.labels(pool, instance).inc()
        self._healthy.labels(pool, instance).set(1 if healthy else 0)

    # -- histograms ---------------------------------------------------------------
    def observe_ttft(self, decode_instance: str, seconds: float) -> None:
        self._ttft.labels(self.pool_name, decode_instance).observe(max(0.0, seconds))

    def observe_tpot(self, decode_instance: str, seconds: float) -> None:
        self._tpot.labels(self.pool_name, decode_instance).observe(max(0.0, seconds))

    def observe_prefill_leg(self, prefill_instance: str, seconds: float) -> None:
        self._prefill_leg.labels(self.pool_name, prefill_instance).observe(max(0.0, seconds))

    def render(self) -> tuple[bytes, str]:
        """``(body, content_type)`` of the text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
