"""Table-driven unit tests of the scheduler's in-flight accounting: synchronous
scheduling is depth 0 (no placeholders), asynchronous is depth 1 (a step's tokens count
as placeholders until it lands; the next step is scheduled on them). Both give the same
token stream; the masks of constrained requests are filled before or after the step in
flight lands."""

from __future__ import annotations

from typing import Any

import pytest
from _sched_sim import FakeRunner, Loop, request, scheduler, truth

from pdserve.engine.request import Request


def t(pos: int) -> int:
    return truth("a", pos)


def _placeholders_run(async_scheduling: bool) -> tuple[Loop, list[Any], list[int]]:
    s = scheduler(k=2, async_scheduling=async_scheduling)
    loop = Loop(s, FakeRunner(k=2))
    a = request("a", 5, 7)
    s.add_request(a)
    steps, placeholders = [], []
    while s.has_unfinished_requests():
        steps.append(loop.step())
        placeholders.append(a.num_output_placeholders)
    return loop, steps, placeholders


@pytest.mark.parametrize(
    ("async_scheduling", "steps", "drafts", "placeholders"),
    [
        (False, [5, 3, 3], [[], [t(6), t(7)], [t(9), t(10)]], [0, 0, 0]),
        # depth 1: after step N is scheduled step N-1 lands; the drafts are the device's;
        # the 4th step is empty: the 3rd's tokens in flight reach max_tokens
        (True, [5, 3, 3, 0], [[], [-1, -1], [-1, -1], []], [1, 3, 3, 0]),
    ],
    ids=["sync", "async"],
)
def test_placeholders_by_depth(
    async_scheduling: bool, steps: list[int], drafts: list[list[int]], placeholders: list[int]
) -> None:
    loop, sos, ph = _placeholders_run(async_scheduling)
    assert [so.total_num_scheduled_tokens for so in sos] == steps
    assert [so.scheduled_spec_decode_tokens.get("a", []) for so in sos] == drafts
    assert ph == placeholders
    assert loop.tokens["a"] == [t(5 + j) for j in range(7)] and loop.finish == {"a": "length"}


def _r(rid: str, prompt: int, max_tokens: int, **kw: Any) -> Request:
    return request(rid, prompt, max_tokens, **kw)


def _workload(name: str) -> tuple[dict[str, Any], dict[int, list[Request]], int]:
    """(scheduler settings, arrivals, drafts k) of one parity row."""
    stop = {"stop_token_ids": [truth("b", 9)]}
    return {
        "chunked": ({"budget": 8, "max_seqs": 2}, {0: [_r("a", 13, 5), _r("b", 3, 7)], 2: [_r("c", 9, 4)]}, 0),
        "stops": ({}, {0: [_r("a", 4, 3), _r("b", 6, 20, **stop)]}, 0),
        "max_model_len": ({"max_model_len": 12}, {0: [_r("a", 8, 20), _r("b", 10, 20)]}, 0),
        "drafts": ({"lookahead": 2}, {0: [_r("a", 5, 9), _r("b", 7, 8)], 1: [_r("c", 3, 6)]}, 2),
        "drafts_stop": ({}, {0: [_r("a", 3, 9), _r("b", 5, 12, **stop)]}, 3),
        "preemption": ({"num_blocks": 7, "prefix_caching": False}, {0: [_r("a", 7, 9), _r("b", 6, 9), _r("c", 5, 9)]}, 0),
        "preemption_drafts": ({"num_blocks": 8, "prefix_caching": False}, {0: [_r("a", 7, 9), _r("b", 6, 9)]}, 2),
        "priority": ({"num_blocks": 7, "policy": "priority", "prefix_caching": False},
                     {0: [_r("a", 7, 9, priority=2)], 1: [_r("b", 6, 9, priority=0, arrival=1.0)]}, 0),
    }[name]  # fmt: skip


PARITY = ["chunked", "stops", "max_model_len", "drafts", "drafts_stop", "preemption",
          "preemption_drafts", "priority"]  # fmt: skip


@pytest.mark.parametrize("name", PARITY)
def test_sync_and_async_give_the_same_stream(name: str) -> None:
    """Depth 0 and depth 1 produce each request's model stream with the same finish;
    only depth 1 ever has placeholders; every block is free in the end."""
    runs = {}
    for depth in (0, 1):
        settings, arrivals, k = _workload(name)
        s = scheduler(async_scheduling=bool(depth), k=k, **settings)
        loop = Loop(s, FakeRunner(k=k, wrong=lambda rid, pos: pos % 3 == 0))
        reqs = [r for rs in arrivals.values() for r in rs]
        seen = 0
        for i in range(100):
            for r in arrivals.pop(i, []):
                s.add_request(r)
            if not arrivals and not s.has_unfinished_requests():
                break
            loop.step()
            seen = max([seen, *(r.num_output_placeholders for r in reqs)])
        else:
            pytest.fail("not done after 100 steps")
        runs[depth] = (loop.tokens, loop.finish, seen, s.stats.num_preemptions)
        for r in reqs:
            assert loop.tokens[r.request_id] == [
                truth(r.request_id, r.num_prompt_tokens + j) for j in range(r.num_output_tokens)
            ]
        assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks
    (tok0, fin0, seen0, pre0), (tok1, fin1, seen1, pre1) = runs[0], runs[1]
    assert tok0 == tok1 and fin0 == fin1
    assert seen0 == 0 and seen1 > 0
    if name.startswith("preemption") or name == "priority":
        assert pre0 > 0 and pre1 > 0
    if name.endswith("stop") or name == "stops":
        assert fin0["b"] == "stop"


@pytest.mark.parametrize(
    ("async_scheduling", "defer", "deferred", "lands_first"),
    [(False, True, False, False), (True, True, True, False), (True, False, False, True)],
    ids=["sync", "async_deferred", "async_land_first"],
)
def test_bad_word_bans_see_the_token_before(
    async_scheduling: bool, defer: bool, deferred: bool, lands_first: bool
) -> None:
    """A two-token bad word bans its last token right after its first was sampled. At
    depth 1 the ban needs the token in flight: the masks are filled after the step in
    flight lands (deferred), or, without deferral (TP), that step lands before the
    next is scheduled."""
    s = scheduler(async_scheduling=async_scheduling)
    s.defer_masks = defer
    loop = Loop(s)
    s.add_request(request("a", 5, 3, bad_words_token_ids=[[t(5), 7], [8]]))
    first = loop.step()
    assert first.bad_word_bans == {"a": [8]} and first.masks_deferred is deferred
    assert s.waits_for_landed_tokens() is lands_first
    second = loop.step()
    assert second.masks_deferred is deferred and second.num_scheduled_tokens == {"a": 1}
    assert second.bad_word_bans == {"a": [7, 8]}  # the output ends with t(5)
    third = loop.step()
    assert third.bad_word_bans == {"a": [8]}
    loop.run()
    assert loop.tokens["a"] == [t(5), t(6), t(7)]


def test_without_deferral_a_constrained_request_sits_out_its_step_in_flight() -> None:
    """Depth 1, masks not deferred, and nobody lands the step first: the request whose
    next mask needs the token in flight is not scheduled."""
    s = scheduler(async_scheduling=True)
    s.defer_masks = False
    a, b = request("a", 5, 3, bad_words_token_ids=[[t(5), 7]]), request("b", 5, 3)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["a", "b"] and a.num_output_placeholders == 1
    so = s.schedule()  # a step in flight for both
    assert list(so.num_scheduled_tokens) == ["b"] and not so.masks_deferred
