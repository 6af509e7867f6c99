"""Table-driven unit tests of the scheduler's remote KV part (a P/D decode instance):
a prompt whose KV comes from prefill is parked while the pull is in flight, runs once
the connector reports it (its last prompt token recomputed), follows the load-failure
policy when the pull fails, and may pad its first step to the uniform verify shape."""

from __future__ import annotations

from typing import Any

import pytest
from _sched_sim import FakeConnector, FakeRunner, Loop, request, scheduler, truth

from pdserve.core_types.kv_connector import KV_LOAD_FAILED, KVConnectorOutput
from pdserve.engine.request import RequestStatus


def _parked(async_scheduling: bool = False, **settings: Any) -> tuple[Loop, FakeConnector]:
    conn = FakeConnector()
    s = scheduler(connector=conn, async_scheduling=async_scheduling, **settings)
    k = settings.get("k", 0)
    loop = Loop(s, FakeRunner(k=k))
    s.add_request(request("a", 9, 4, remote=True))
    so = loop.step()
    assert so.is_empty and conn.loads == [("a", 8)]  # every prompt token but the last
    a = s.requests["a"]
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KV and s.waiting_remote == {"a": a}
    assert s.kv.num_blocks("a") == 2 and a.num_computed_tokens == 0
    assert not s.has_schedulable_work() and s.has_unfinished_requests()
    return loop, conn


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_pulled_prompt_runs_from_its_last_token(async_scheduling: bool) -> None:
    loop, _ = _parked(async_scheduling)
    s = loop.sched
    pulled = s.kv.block_ids("a")
    assert loop.step().is_empty  # the pull is still in flight
    loop.kv_out = KVConnectorOutput(finished_recving={"a"})
    assert loop.step().is_empty  # the report lands with this step
    assert [r.request_id for r in s.waiting] == ["a"] and s.requests["a"].num_computed_tokens == 8
    steps = loop.run()
    assert [list(so.num_scheduled_tokens.items()) for so in steps[:2]] == [[("a", 1)], [("a", 1)]]
    (new,) = steps[0].scheduled_new_reqs
    # the blocks the KV was pulled into, then one for the token computed here
    assert new.num_computed_tokens == 8 and new.block_ids[:2] == pulled and len(new.block_ids) == 3
    assert loop.tokens["a"] == [truth("a", 9 + j) for j in range(4)]
    src = s.stats.prompt_tokens_by_source
    assert src == {"local_compute": 1, "local_cache_hit": 0, "external_kv_transfer": 8}
    assert s.make_stats().num_waiting_for_remote_kv == 0


@pytest.mark.parametrize(
    ("policy", "steps", "finish"),
    [
        ("fail", [], "error"),
        ("recompute", [[("a", 9)], [("a", 1)], [("a", 1)], [("a", 1)]], "length"),
    ],
)
def test_a_failed_pull_follows_the_policy(
    policy: str, steps: list[list[tuple[str, int]]], finish: str
) -> None:
    loop, conn = _parked(failure_policy=policy)
    s = loop.sched
    loop.kv_out = KVConnectorOutput(failed_recving={"a": "lease gone"})
    loop.step()
    assert conn.given_up == ["a"] and s.stats.kv_transfer_failures == 1
    assert [list(so.num_scheduled_tokens.items()) for so in loop.run()] == steps
    assert loop.finish == {"a": finish}
    if policy == "fail":
        (out,) = loop.outputs
        assert out.error == f"{KV_LOAD_FAILED}: lease gone" and not out.new_token_ids
    else:
        assert loop.tokens["a"] == [truth("a", 9 + j) for j in range(4)]
        assert s.stats.prompt_tokens_by_source["local_compute"] == 9
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks and not s.requests


def test_aborting_a_parked_request_frees_its_blocks() -> None:
    loop, _ = _parked()
    s = loop.sched
    (done,) = s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert done.status == RequestStatus.FINISHED_ABORTED and not s.waiting_remote
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks
    assert s.schedule().finished_req_ids == {"a"}


@pytest.mark.parametrize(
    ("settings", "first", "padded"),
    [
        # the first step verifies k placeholders: the uniform 1 + k shape of a decode
        ({"k": 2, "pad_first_step": True}, 3, 1),
        ({"k": 2}, 1, 0),
        # no room for 1 + k positions before max_model_len: not padded
        ({"k": 2, "pad_first_step": True, "max_model_len": 11}, 1, 0),
    ],
    ids=["padded", "off", "no_room"],
)
def test_first_step_padding_after_a_hand_off(
    settings: dict[str, Any], first: int, padded: int
) -> None:
    loop, _ = _parked(**settings)
    s = loop.sched
    loop.kv_out = KVConnectorOutput(finished_recving={"a"})
    loop.step()
    so = loop.step()
    assert so.num_scheduled_tokens == {"a": first}
    assert so.scheduled_spec_decode_tokens == ({"a": [-1, -1]} if padded else {})
    assert so.padded_spec_decode_req_ids == ({"a"} if padded else set())
    assert s.stats.spec_num_padded_steps == padded
    # placeholders are never accepted, and a padded row is not counted as a verify
    assert s.stats.spec_num_drafts == 0 and loop.tokens["a"] == [truth("a", 9)]
    assert s.requests["a"].num_computed_tokens == 9
    loop.run()
    n = min(4, settings.get("max_model_len", 256) - 9)
    assert loop.tokens["a"] == [truth("a", 9 + j) for j in range(n)]
