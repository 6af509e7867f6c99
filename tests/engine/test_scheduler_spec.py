"""Table-driven unit tests of the scheduler's speculative decoding: which drafts a step
verifies, how a landed verify moves ``num_computed_tokens`` and the blocks, the
acceptance counters, lookahead slots and the adaptive draft count (``_sched_sim``'s
stand-in runner accepts the leading drafts that match the model's stream)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from _sched_sim import FakeRunner, Loop, never, request, scheduler, truth

from pdserve.engine.sched.spec import SpecSchedule
from pdserve.spec_decode.draft_policy import DraftPolicy


def t(pos: int) -> int:
    return truth("a", pos)


def always(rid: str, pos: int) -> bool:
    return True


def odd(rid: str, pos: int) -> bool:
    return pos % 2 == 1


@dataclass
class Row:
    prompt: int
    max_tokens: int
    wrong: Callable[[str, int], bool]  # the drafter's wrong guesses
    steps: list[int]  # tokens scheduled per step
    drafts: dict[int, list[int]]  # step -> the drafts it verifies
    counters: tuple[int, int, int, list[int]]  # verifies, drafts, accepted, accepted by pos
    outputs: int  # output tokens in the end
    settings: dict[str, Any] = field(default_factory=dict)
    sp: dict[str, Any] = field(default_factory=dict)
    finish: str = "length"


ROWS = {
    # every draft right: 1 + 2 tokens a verify
    "accepted": Row(5, 7, never, [5, 3, 3], {1: [t(6), t(7)], 2: [t(9), t(10)]}, (2, 4, 4, [2, 2]), 7),
    # every draft wrong: one token a verify, the draft slots recomputed
    "rejected": Row(5, 4, always, [5, 3, 3, 3], {1: [1, 1], 2: [1, 1], 3: [1, 1]}, (3, 6, 0, [0, 0]), 4),
    # the second draft always wrong: two tokens a verify
    "half": Row(5, 7, odd, [5, 3, 3, 3], {1: [t(6), 1], 2: [t(8), 1], 3: [t(10), 1]}, (3, 6, 3, [3, 0]), 7),
    # a stop token inside a verify: drafts accepted past it are dropped and not counted
    "stop_inside": Row(5, 9, never, [5, 3], {1: [t(6), t(7)]}, (1, 2, 1, [1, 0]), 3, sp={"stop_token_ids": [t(7)]}, finish="stop"),
    # min_tokens: no drafts until that many tokens are out (bans need exact counts)
    "min_tokens": Row(5, 6, never, [5, 1, 1, 3], {3: [t(8), t(9)]}, (1, 2, 2, [1, 1]), 6, sp={"min_tokens": 3}),
    # drafts capped so that positions stay within max_model_len, not by max_tokens
    "max_model_len": Row(9, 100, never, [9, 2], {1: [t(10)]}, (1, 1, 1, [1]), 3, settings={"max_model_len": 12}),
    "max_tokens": Row(5, 2, never, [5, 3], {1: [t(6), t(7)]}, (1, 2, 0, [0, 0]), 2),
}  # fmt: skip


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_verify_table(row: Row) -> None:
    s = scheduler(k=2, **row.settings)
    loop = Loop(s, FakeRunner(k=2, wrong=row.wrong))
    a = request("a", row.prompt, row.max_tokens, **row.sp)
    s.add_request(a)
    steps, left = [], []
    while s.has_unfinished_requests():
        steps.append(loop.step())
        left.append(a.num_tokens - a.num_computed_tokens)
        assert len(steps) < 20
    assert [so.total_num_scheduled_tokens for so in steps] == row.steps
    verified = {i: so.scheduled_spec_decode_tokens.get("a") for i, so in enumerate(steps)}
    assert {i: d for i, d in verified.items() if d} == row.drafts
    # a landed verify leaves exactly the last known token to compute
    assert left[:-1] == [1] * (len(steps) - 1)
    st = s.stats
    counters = (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens)
    assert (*counters, st.spec_num_accepted_tokens_per_pos) == row.counters
    assert loop.tokens["a"] == [t(row.prompt + j) for j in range(row.outputs)]
    assert loop.finish == {"a": row.finish}
    assert all(so.propose_drafts for so in steps) and st.spec_steps_by_num_drafts == [
        0,
        0,
        len(steps),
    ]


@pytest.mark.parametrize(
    ("lookahead", "max_model_len", "blocks"),
    [(0, 256, 4), (2, 256, 6), (2, 5, 5)],
    ids=["none", "two", "capped_by_max_model_len"],
)
def test_lookahead_slots(lookahead: int, max_model_len: int, blocks: int) -> None:
    """Slots reserved past a step (MTP writes draft KV there), never past max_model_len
    (blocks of one token count slots)."""
    s = scheduler(block_size=1, k=2, lookahead=lookahead, max_model_len=max_model_len)
    s.add_request(request("a", 4, 1))
    s.schedule()
    assert s.kv.num_blocks("a") == blocks


def test_rejected_drafts_give_their_slots_back_but_keep_the_lookahead() -> None:
    s = scheduler(block_size=1, k=2, lookahead=2)
    loop = Loop(s, FakeRunner(k=2, wrong=always))
    s.add_request(request("a", 4, 3))
    loop.step()  # the prompt: 4 slots + 2 ahead
    assert s.kv.num_blocks("a") == 6
    so = s.schedule()  # a verify of 2 drafts: 4 + 3 computed + 2 ahead
    assert so.num_scheduled_tokens == {"a": 3} and s.kv.num_blocks("a") == 9
    loop.land(so, loop.runner.execute(so))  # both drafts rejected
    assert s.requests["a"].num_computed_tokens == 5 and s.kv.num_blocks("a") == 7


class ByBatch(DraftPolicy):
    """Two drafts for a lone request, none for a batch; records its observations."""

    def __init__(self) -> None:
        super().__init__(2)
        self.seen: list[tuple[list[int], list[int]]] = []
        self.timed: list[tuple[int, int, int, float]] = []

    def choose(self, batch: int, context: int = 0) -> int:
        return 2 if batch == 1 else 0

    def observe(self, verified: Sequence[int], accepted: Sequence[int]) -> None:
        self.seen.append((list(verified), list(accepted)))

    def observe_cost(self, batch: int, context: int, j: int, seconds: float) -> None:
        self.timed.append((batch, context, j, seconds))


def test_adaptive_draft_count() -> None:
    """A step the policy gives no drafts runs no drafter, so the next step has none to
    verify either; the policy sees each landed step's (drafts, accepted) rows."""
    policy = ByBatch()
    s = scheduler(k=2)
    s.spec.policy = policy
    loop = Loop(s, FakeRunner(k=2))
    steps = loop.run({0: [request("a", 4, 2), request("b", 4, 6)]})
    assert [list(so.num_scheduled_tokens.items()) for so in steps] == [
        [("a", 4), ("b", 4)],
        [("a", 1), ("b", 1)],
        [("b", 1)],  # j = 2 now, but the step before proposed nothing
        [("b", 3)],
    ]
    assert [so.propose_drafts for so in steps] == [False, False, True, True]
    assert s.stats.spec_steps_by_num_drafts == [2, 0, 2] and s.stats.spec_last_num_drafts == 2
    assert policy.seen == [([2], [2])]
    assert loop.tokens["b"] == [truth("b", 4 + j) for j in range(6)]
    # what each uniform step took goes to the policy: not the prompts, not the step that
    # proposes drafts it does not verify (between j = 0 and drafting)
    assert [so.spec_step_shape for so in steps] == [None, (2, 5, 0), None, (1, 7, 2)]
    assert [(b, c, j) for b, c, j, _ in policy.timed] == [(2, 5, 0), (1, 7, 2)]
    assert all(sec > 0 for *_, sec in policy.timed)


def test_landed_steps_are_timed_by_the_device_where_it_was_measured() -> None:
    """The runner's CUDA-event time of a step wins over the host's clock (which counts
    host stalls and idle gaps); without it, the host's clock from the step's scheduling
    or the landing before it, whichever came later."""
    policy = ByBatch()
    sp = SpecSchedule(2, 100, pad_first_step=False, policy=policy)
    sp.landed((1, 7, 2), scheduled_at=1.0, now=1.5)
    sp.landed((1, 7, 2), scheduled_at=1.2, now=1.75)  # in flight behind the first
    sp.landed((1, 7, 2), scheduled_at=2.0, now=9.0, device_s=0.03)
    sp.landed(None, scheduled_at=9.0, now=9.5, device_s=0.03)  # not a uniform shape
    assert policy.timed == [(1, 7, 2, 0.5), (1, 7, 2, 0.25), (1, 7, 2, 0.03)]
