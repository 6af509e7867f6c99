"""The DP step agreement's arithmetic (what every rank decides from one max all-reduce),
the client's routing and stats merge, and the rank device choice, without processes."""

from __future__ import annotations

import pytest

from pdserve.core_types.stats import SchedulerStats
from pdserve.distributed import RankInfo
from pdserve.distributed.device import rank_device
from pdserve.distributed.dp_sync import LocalStep, StepPlan
from pdserve.frontend.dp_ranks import RankRouter, merge_stats


def agree(*ranks: LocalStep) -> StepPlan:
    """What the all-reduce (element-wise max) gives every rank."""
    vecs = [r.encode() for r in ranks]
    return StepPlan.decode([max(col) for col in zip(*vecs, strict=True)])


def step(
    tokens: int = 0, reqs: int = 0, q: int | None = None, pending: bool = False, seq: int = 0
) -> LocalStep:
    return LocalStep(tokens, reqs, q, pending, seq)


def test_uniform_decode_agrees_only_when_every_busy_rank_has_the_same_q() -> None:
    p = agree(step(8, 8, 1), step(3, 3, 1))
    assert p.any_busy and p.uniform_q == 1 and p.max_reqs == 8 and p.max_tokens == 8
    assert agree(step(8, 8, 1), step()).uniform_q == 1  # an idle rank does not constrain
    assert agree(step(8, 2, 4), step(3, 3, 1)).uniform_q is None  # 1+3 verify vs decode
    assert agree(step(8, 2, None), step(3, 3, 1)).uniform_q is None  # a prompt somewhere
    assert agree(step(8, 2, None), step()).uniform_q is None


def test_idle_ranks_stop_stepping_only_when_all_are_idle_and_caught_up() -> None:
    idle = agree(step(seq=3), step(seq=3))
    assert not idle.any_busy and not idle.keep_stepping
    assert agree(step(seq=3), step(pending=True, seq=3)).keep_stepping  # waiting for KV
    behind = agree(step(seq=2), step(seq=3))  # a wake (and the work before it) in flight
    assert behind.keep_stepping and behind.max_wake_seq == 3 and not behind.wake_seq_agrees
    stop = LocalStep(0, 0, None, False, 3, stopping=True)
    assert agree(stop, step(seq=3)).stop


def test_router_balances_and_keeps_owners() -> None:
    r = RankRouter(2)
    assert [r.assign(f"a{i}") for i in range(4)] == [0, 1, 0, 1]
    r.release("a0")
    r.release("a2")
    assert r.assign("b") == 0 and r.owner["b"] == 0 and r.load == [1, 2]
    r.release("unknown")  # finished twice / never assigned: ignored
    assert r.load == [1, 2]


def test_merged_stats_sum_counters_and_weigh_kv_usage_by_blocks() -> None:
    a = SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5, step_paths={"graph": 3})
    a.spec_num_accepted_tokens_per_pos = [4, 1]
    b = SchedulerStats(num_running_reqs=1, kv_cache_usage=0.0, step_paths={"graph": 1})
    b.kv_transfer_healthy, b.kv_transfer_unhealthy_reason = False, "server thread died"
    b.kv_transfer_seconds = [0.25]
    b.spec_num_accepted_tokens_per_pos = [2]
    m = merge_stats([a, b], [100, 300], {"engine_core_dp0": 7}, fresh=b)
    assert m.num_running_reqs == 3 and m.kv_cache_usage == pytest.approx(50 / 400)
    assert m.step_paths == {"graph": 4} and m.spec_num_accepted_tokens_per_pos == [6, 1]
    assert (
        not m.kv_transfer_healthy and m.kv_transfer_unhealthy_reason == "rank 1: server thread died"
    )
    assert m.kv_transfer_seconds == [0.25] and m.process_rss_bytes == {"engine_core_dp0": 7}


def test_rank_device() -> None:
    two = RankInfo(dp_size=2, dp_rank=1)
    assert rank_device("cpu", two).type == "cpu"
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            rank_device("cuda", two)


class _Graphs:
    """The two things ``plan_graph_key`` reads of a CudaGraphManager."""

    query_lens = (1, 4)
    widths = [256, 1024]

    def padded_size(self, num_reqs: int, q: int) -> int | None:
        return next((s for s in (1, 2, 4, 8) if s >= num_reqs), None)


def test_every_rank_picks_the_same_graph_from_the_plan() -> None:
    from pdserve.runner.dummy_step import plan_graph_key

    g = _Graphs()
    assert plan_graph_key(g, agree(step(3, 3, 1), step())) == (4, 1, 1024)  # type: ignore[arg-type]
    assert plan_graph_key(g, agree(step(8, 2, 4), step(3, 1, 4))) == (2, 4, 1024)  # type: ignore[arg-type]
    assert plan_graph_key(g, agree(step(9, 9, 1), step())) is None  # type: ignore[arg-type]
    assert plan_graph_key(g, agree(step(6, 3, 2), step())) is None  # type: ignore[arg-type]
    assert plan_graph_key(None, agree(step(3, 3, 1), step())) is None
