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
    # P/D decode: first steps padded with placeholder drafts to the uniform 1+k shape
    spec_num_padded_steps: int = 0
    # steps with running requests by the draft count chosen for them (index j = 0..k;
    # k every step with a fixed policy), and the latest choice
    spec_steps_by_num_drafts: list[int] = field(default_factory=list)
    spec_last_num_drafts: int = 0
    num_generated_tokens: int = 0  # cumulative: output tokens the engine produced
    # expert parallelism, cumulative: DP step agreements run (one per loop iteration: a
    # few a second while every rank is idle) and dummy forwards ("dummy:*" step paths)
    dp_step_agreements: int = 0
    # resident set size of each engine-side process, bytes: {"engine_core": n}
    process_rss_bytes: dict[str, int] = field(default_factory=dict)


def stats_line(prev: SchedulerStats, cur: SchedulerStats, seconds: float) -> str:
    """The engine's periodic log line: throughput over the ``seconds`` between two
    snapshots, the queue, KV usage and prefix hits, and speculative acceptance (mean
    acceptance length = 1 + accepted / verifies, as vLLM reports it)."""
    dt = max(seconds, 1e-9)
    prompt = sum(cur.prompt_tokens_by_source.values()) - sum(prev.prompt_tokens_by_source.values())
    gen = cur.num_generated_tokens - prev.num_generated_tokens
    q = cur.prefix_cache_queries - prev.prefix_cache_queries
    hits = cur.prefix_cache_hits - prev.prefix_cache_hits
    line = (
        f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, "
        f"Avg generation throughput: {gen / dt:.1f} tokens/s, "
        f"Running: {cur.num_running_reqs} reqs, Waiting: {cur.num_waiting_reqs} reqs, "
        f"KV cache usage: {100 * cur.kv_cache_usage:.1f}%, "
        f"Prefix cache hit rate: {100 * hits / q if q else 0.0:.1f}%"
    )
    verifies = cur.spec_num_drafts - prev.spec_num_drafts
    if verifies > 0:
        drafted = cur.spec_num_draft_tokens - prev.spec_num_draft_tokens
        accepted = cur.spec_num_accepted_tokens - prev.spec_num_accepted_tokens
        old = prev.spec_num_accepted_tokens_per_pos
        per_pos = [
            (n - (old[i] if i < len(old) else 0)) / verifies
            for i, n in enumerate(cur.spec_num_accepted_tokens_per_pos)
        ]
        line += (
            f"; SpecDecoding: mean acceptance length {1 + accepted / verifies:.2f}, "
            f"acceptance rate {100 * accepted / drafted if drafted else 0.0:.1f}%, "
            f"accepted {accepted} / drafted {drafted} tokens, per-position acceptance "
            + ", ".join(f"{r:.3f}" for r in per_pos)
        )
    return line
