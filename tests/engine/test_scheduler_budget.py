"""Table-driven unit tests of the scheduler's budget, admission, preemption and policies,
through ``schedule`` / ``update_from_output`` with a stand-in runner (``_sched_sim``).

A row is (scheduler settings, requests by the step they arrive before) -> the tokens
each step schedules per request, in batch order, and the requests each step preempts.
Every row also checks that each request's output is the model's stream (``truth``),
whatever chunking or preemption did to it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
from _sched_sim import Loop, request, scheduler, truth

from pdserve.engine.request import Request, RequestStatus


def stream(req: Request, n: int) -> list[int]:
    return [truth(req.request_id, req.num_prompt_tokens + j) for j in range(n)]


@dataclass
class Row:
    settings: dict[str, Any]
    arrivals: dict[int, list[Callable[[], Request]]]  # made fresh by each run of the row
    steps: list[list[tuple[str, int]]]  # per step: (request, tokens) in batch order
    preempted: dict[int, set[str]] = field(default_factory=dict)  # step -> preempted ids
    finish: str = "length"


def _r(rid: str, prompt: int, max_tokens: int = 2, **kw: Any) -> Callable[[], Request]:
    # (a factory: Request objects made at import would outlive every test, and the
    # engine's leak tests count the live ones)
    return partial(request, rid, prompt, max_tokens, **kw)


ROWS = {
    # a prompt longer than the budget is chunked; it samples once its last chunk runs
    "chunked_prefill": Row(
        {"budget": 8}, {0: [_r("a", 20)]}, [[("a", 8)], [("a", 8)], [("a", 4)], [("a", 1)]]
    ),
    # running requests first (a decode), a new prompt takes what budget is left
    "running_first": Row(
        {"budget": 10},
        {0: [_r("a", 6, 4)], 1: [_r("b", 20, 2)]},
        [[("a", 6)], [("a", 1), ("b", 9)], [("a", 1), ("b", 9)], [("a", 1), ("b", 2)], [("b", 1)]],
    ),
    # max_num_seqs: the third request waits for a running slot
    "max_num_seqs": Row(
        {"max_seqs": 2},
        {0: [_r("a", 3), _r("b", 3), _r("c", 3)]},
        [[("a", 3), ("b", 3)], [("a", 1), ("b", 1)], [("c", 3)], [("c", 1)]],
    ),
    # without chunked prefill a prompt that does not fit the budget left waits whole
    "no_chunking": Row(
        {"budget": 8, "chunked": False},
        {0: [_r("a", 6, 1), _r("b", 5, 1)]},
        [[("a", 6)], [("b", 5)]],
    ),
    "chunking": Row(
        {"budget": 8},
        {0: [_r("a", 6, 1), _r("b", 5, 1)]},
        [[("a", 6), ("b", 2)], [("b", 3)]],
    ),
    # 4 usable blocks of 4: two 7-token prompts fill them; at the 9th token a needs a
    # block and fcfs preempts the latest admitted (b), which recomputes once a is done
    "preempt_fcfs": Row(
        {"num_blocks": 5, "budget": 64, "prefix_caching": False},
        {0: [_r("a", 7, 5), _r("b", 7, 3)]},
        [
            [("a", 7), ("b", 7)],
            [("a", 1), ("b", 1)],
            [("a", 1)],
            [("a", 1)],
            [("a", 1)],
            [("b", 9)],
        ],
        preempted={2: {"b"}},
    ),  # fmt: skip
    # the same pressure under priority: a (priority 1) was admitted first, b (0) after;
    # the victim is the lowest priority among those not yet scheduled: a itself, so the
    # walk ends there and b is not scheduled either in that step
    "preempt_priority": Row(
        {"num_blocks": 5, "budget": 64, "prefix_caching": False, "policy": "priority"},
        {0: [_r("a", 7, 3, priority=1)], 1: [_r("b", 7, 3, priority=0, arrival=1.0)]},
        [[("a", 7)], [("a", 1), ("b", 7)], [], [("b", 1)], [("b", 1)], [("a", 9)]],
        preempted={2: {"a"}},
    ),
    # a waiting request never preempts to get in, whatever its priority
    "no_preempt_to_admit": Row(
        {"num_blocks": 5, "policy": "priority", "prefix_caching": False},
        {0: [_r("a", 12, 2, priority=5)], 1: [_r("b", 8, 2, priority=0, arrival=1.0)]},
        [[("a", 12)], [("a", 1)], [("b", 8)], [("b", 1)]],
    ),
    # priority admission: (priority, arrival), lower first; ties by arrival
    "priority_order": Row(
        {"max_seqs": 1, "policy": "priority"},
        {0: [_r(f"r{i}", 3, 1, priority=p, arrival=float(i)) for i, p in enumerate([5, 0, 3, 0])]},
        [[("r1", 3)], [("r3", 3)], [("r2", 3)], [("r0", 3)]],
    ),
    "fcfs_order": Row(
        {"max_seqs": 1},
        {0: [_r(f"r{i}", 3, 1, arrival=float(i)) for i in range(3)]},
        [[("r0", 3)], [("r1", 3)], [("r2", 3)]],
    ),
    # a stop token ends a request before max_tokens
    "stop_token": Row(
        {},
        {0: [_r("a", 4, 10, stop_token_ids=[truth("a", 6)])]},
        [[("a", 4)], [("a", 1)], [("a", 1)]],
        finish="stop",
    ),
    # min_tokens: the stop token is ignored until that many tokens are out
    "min_tokens": Row(
        {},
        {0: [_r("a", 4, 10, stop_token_ids=[truth("a", 4)], min_tokens=2)]},
        [[("a", 4)]] + [[("a", 1)]] * 9,
    ),
    # the request's length limit is max_model_len when that comes first
    "max_model_len": Row({"max_model_len": 7}, {0: [_r("a", 5, 10)]}, [[("a", 5)], [("a", 1)]]),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_schedule_table(row: Row) -> None:
    loop = Loop(scheduler(**row.settings))
    arrivals = {step: [make() for make in fs] for step, fs in row.arrivals.items()}
    reqs = {r.request_id: r for rs in arrivals.values() for r in rs}
    steps = loop.run(arrivals)
    assert [list(so.num_scheduled_tokens.items()) for so in steps] == row.steps
    assert {i: so.preempted_req_ids for i, so in enumerate(steps) if so.preempted_req_ids} == (
        row.preempted
    )
    for rid, req in reqs.items():
        assert loop.tokens[rid] == stream(req, req.num_output_tokens)
        assert req.num_preemptions == sum(rid in p for p in row.preempted.values())
    assert loop.finish == dict.fromkeys(reqs, row.finish)
    s = loop.sched
    assert s.stats.num_preemptions == sum(map(len, row.preempted.values()))
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks and not s.kv.req_blocks


def test_a_preempted_request_resumes_with_its_outputs_as_prompt() -> None:
    """Recompute: the victim's blocks and progress go, its output stays; it resumes at
    the waiting queue's front (no admission in the step that preempted) and is sent to
    the runner again as a new request whose tokens are its prompt and output."""
    s = scheduler(num_blocks=5, budget=64, prefix_caching=False)
    loop = Loop(s)
    a, b, c = request("a", 7, 5), request("b", 7, 3), request("c", 2, 1)
    s.add_request(a)
    s.add_request(b)
    loop.step()
    loop.step()
    assert s.kv.num_free_blocks == 0
    s.add_request(c)  # arrives after b; one free block would fit it
    so = loop.step()
    assert so.preempted_req_ids == {"b"} and list(so.num_scheduled_tokens) == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens == 2 and not s.kv.block_ids("b")
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert s.kv.num_free_blocks == 1
    steps = loop.run(max_steps=5)
    # b at the head needs 3 blocks: c waits behind it until a is done
    assert [list(so.num_scheduled_tokens.items()) for so in steps] == [
        [("a", 1)],
        [("a", 1)],
        [("b", 9), ("c", 2)],
    ]
    new = {n.req_id: n for n in steps[-1].scheduled_new_reqs}
    assert new["b"].token_ids == b.prompt_token_ids + b.output_token_ids[:2]
    assert new["b"].num_computed_tokens == 0 and b.num_preemptions == 1
    assert loop.tokens["b"] == stream(b, 3)
