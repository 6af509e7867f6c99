"""Stats snapshots the engine core emits every step (plain data, no Prometheus here).

The engine core fills one :class:`SchedulerStats` per step from the scheduler and
KV cache manager; counters are cumulative since start so that a consumer that
misses a snapshot loses nothing. ``metrics/prometheus.py`` turns them into series.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_rss_bytes() -> int:
    """This process's resident set size from /proc (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_for_remote_kv: int = 0
    kv_cache_usage: float = 0.0  # 0..1, share of usable blocks in use
    # cumulative counters
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    prompt_tokens_by_source: dict[str, int] = field(
        default_factory=lambda: {
            "local_compute": 0,
            "local_cache_hit": 0,
            "external_kv_transfer": 0,
        }
    )
    # which forward path ran, cumulative: {"eager:<reason>": n, "graph": n}
    step_paths: dict[str, int] = field(default_factory=dict)
    num_steps: int = 0
    # P/D: cumulative failures / expired leases, current holds, and this snapshot's transfers
    kv_transfer_failures: int = 0
    kv_leases_expired: int = 0
    kv_held_for_remote_decode: int = 0
    kv_transfer_seconds: list[float] = field(default_factory=list)  # drained per snapshot
    kv_transfer_bytes: list[int] = field(default_factory=list)  # drained per snapshot
    # P/D side channel: False while a KV server (or puller) thread is down; the API
    # server's /health answers 503 meanwhile, quoting the reason
    kv_transfer_healthy: bool = True
    kv_transfer_unhealthy_reason: str = ""
    kv_transfer_restarts: int = 0  # cumulative: side-channel threads restarted after dying
    # cumulative: side-channel messages the KV server refused, by kind
    # (unauthenticated, malformed, limit)
    kv_side_channel_rejected: dict[str, int] = field(default_factory=dict)
    # speculative decoding, cumulative: verify steps of a request with drafts, drafts
    # scheduled, drafts accepted, and accepted drafts by position (0 = the first draft)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # resident set size of each engine-side process, bytes: {"engine_core": n}
    process_rss_bytes: dict[str, int] = field(default_factory=dict)
