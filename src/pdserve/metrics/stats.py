"""Stats snapshots the engine core emits every step (plain data, no Prometheus here).

The engine core fills one :class:`SchedulerStats` per step from the scheduler and
KV cache manager; counters are cumulative since start so that a consumer that
misses a snapshot loses nothing. ``metrics/prometheus.py`` turns them into series.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
