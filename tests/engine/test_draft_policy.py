"""The adaptive draft count (pdserve.spec_decode.draft_policy): acceptance per position
from verify rows, the expected tokens per step, and the choice by tokens per second."""

from __future__ import annotations

import pytest

from pdserve.spec_decode.draft_policy import (
    COST_BAND,
    COST_MIN_OBS,
    COST_STALE,
    COST_WINDOW,
    EXPLORE_MARGIN,
    EXPLORE_MARGIN_SCALED,
    EXPLORE_TRIES,
    MIN_EVIDENCE,
    PROBE_EVERY,
    PROBE_STEPS,
    DraftPolicy,
)


def _costs(
    k: int, sizes: dict[int, list[float]], width: int = 1024
) -> dict[tuple[int, int, int], float]:
    return {(s, j, width): c for s, row in sizes.items() for j, c in enumerate(row)}


def test_acceptance_is_conditional_on_the_earlier_drafts() -> None:
    p = DraftPolicy(3, decay=1.0)
    # 1000 rows of 3 drafts: 400 reject the first, 300 accept one, 200 two, 100 all three
    verified = [3] * 1000
    accepted = [0] * 400 + [1] * 300 + [2] * 200 + [3] * 100
    p.observe(verified, accepted)
    assert p.reached[1:] == [1000, 600, 300] and p.accepted[1:] == [600, 300, 100]
    assert p.acceptance() == pytest.approx([0.6, 0.5, 1 / 3])
    assert p.expected_tokens() == pytest.approx([1.0, 1.6, 1.9, 2.0])


def test_thin_evidence_leans_on_the_prior_and_rows_without_drafts_count_nothing() -> None:
    p = DraftPolicy(2, prior=0.5, decay=1.0)
    p.observe([0, 2, 2], [0, 2, 2])  # the 0-draft row (a first step) is no evidence
    w = 2 / MIN_EVIDENCE
    assert p.acceptance()[0] == pytest.approx(w * 1.0 + (1 - w) * 0.5)
    q = DraftPolicy(2, decay=0.5)
    q.observe([2], [2])
    q.observe([1], [0])  # decays the first step's counts, then adds its own
    assert q.reached[1:] == [1.5, 0.5] and q.accepted[1:] == [0.5, 0.5]


def test_choice_maximises_tokens_per_second_and_never_loses() -> None:
    p = DraftPolicy(3, decay=1.0)
    p.observe([3] * 1000, [3] * 700 + [0] * 300)  # 0.7 at the first draft, 1.0 after
    gain = p.expected_tokens()
    assert gain == pytest.approx([1.0, 1.7, 2.4, 3.1])
    # small batches: a verify costs little more than a decode step; large ones: much more
    p.set_costs(_costs(3, {8: [10.0, 10.5, 11.0, 11.5], 128: [20.0, 40.0, 60.0, 85.0]}))
    assert p.choose(1) == 3 and p.choose(8) == 3  # runs at the captured size 8
    assert p.choose(100) == 0  # at size 128 every j is slower per token than none
    assert p.choose(300) == 3  # past every captured size: no costs, the ceiling
    p.set_costs(_costs(3, {64: [20.0, 25.0, 40.0, 50.0]}))
    assert p.choose(64) == 1  # 1.7 / 25 beats 1 / 20, 2.4 / 40 and 3.1 / 50
    p.set_costs({(64, 0, 1024): 1.0, (64, 1, 1024): 1.0})  # shapes missing a j: left out
    assert p.sizes == {} and p.choose(64) == 3


def test_the_step_takes_the_costs_of_the_narrowest_width_its_context_fits() -> None:
    p = DraftPolicy(1, prior=0.5, decay=1.0)
    p.observe([1] * 100, [1] * 50 + [0] * 50)  # measured: 0.5
    p.set_costs({**_costs(1, {8: [1.0, 1.1]}, width=4096), **_costs(1, {8: [1.0, 2.0]}, 65536)})
    assert p.widths == [4096, 65536]
    assert p.choose(8, context=3000) == 1  # 1.5 / 1.1 beats 1 / 1
    assert p.choose(8, context=20000) == 0  # the wide graph: 1.5 / 2 loses to 1 / 1
    assert p.choose(8, context=70000) == 1  # wider than every graph: no costs, k


def test_ties_take_fewer_drafts_and_k_must_be_positive() -> None:
    p = DraftPolicy(1, decay=1.0)
    p.observe([1] * 100, [0] * 100)
    p.set_costs({(4, 0, 64): 1.0, (4, 1, 64): 1.0})
    assert p.choose(4) == 0  # a draft never accepted gains nothing
    with pytest.raises(ValueError, match="num_speculative_tokens >= 1"):
        DraftPolicy(0)


def test_reset_forgets_the_measured_acceptance() -> None:
    p = DraftPolicy(2, prior=0.5, decay=1.0)
    p.observe([2] * 100, [0] * 100)
    assert p.acceptance()[0] == pytest.approx(0.0)
    p.reset_acceptance()
    assert p.acceptance() == [0.5, 0.5]


def test_it_measures_before_it_decides_and_probes_while_it_drafts_nothing() -> None:
    p = DraftPolicy(3, prior=0.1, decay=1.0)  # the prior alone would never draft
    p.set_costs(_costs(3, {8: [10.0, 20.0, 30.0, 40.0]}))
    assert p.choose(8) == 3  # no evidence yet: measure
    p.observe([3] * int(MIN_EVIDENCE), [0] * int(MIN_EVIDENCE))  # nothing accepted
    picks = [p.choose(8) for _ in range(3 * PROBE_EVERY)]
    # below k for PROBE_EVERY steps in a row, then k for PROBE_STEPS steps (propose, verify)
    assert picks[: PROBE_EVERY - 1] == [0] * (PROBE_EVERY - 1)
    assert picks[PROBE_EVERY - 1 : PROBE_EVERY - 1 + PROBE_STEPS] == [3] * PROBE_STEPS
    probes = sum(j == 3 for j in picks)
    assert probes == 2 * PROBE_STEPS and probes / len(picks) < 0.01


def test_counts_decay_by_the_steps_between_observations() -> None:
    p = DraftPolicy(1, decay=0.5)
    p.observe([1] * 64, [0] * 64)
    for _ in range(3):
        p.choose(8)  # no costs: k, but the steps count
    p.observe([1], [1])  # the old rows decay by 0.5 ** 3 first
    assert p.reached[1] == pytest.approx(64 * 0.125 + 1)
    assert p.accepted[1] == pytest.approx(1.0)


def test_measured_step_times_replace_an_optimistic_graph_timing() -> None:
    """Run 70's case: at acceptance 0.5 the graphs make j = 2 the choice, but its real steps
    cost more; once measured, the policy moves to j = 1 (measured too) and stays."""
    p = DraftPolicy(2, decay=1.0)
    p.observe([2] * 1000, [0] * 500 + [1] * 250 + [2] * 250)  # 0.5 at each position
    p.set_costs(_costs(2, {128: [23.0, 27.0, 29.0]}, width=32768))
    assert p.step_costs(120, 16400) == [23.0, 27.0, 29.0]
    assert p.choose(120, 16400) == 2  # 1.75 / 29 beats 1.5 / 27 and 1 / 23
    for _ in range(COST_MIN_OBS - 1):
        p.observe_cost(120, 16400, 2, 42.0)
        assert p.choose(120, 16400) == 2  # one time is not yet a measurement
    p.observe_cost(120, 16400, 2, 42.0)
    assert p.step_costs(120, 16400) == [23.0, 27.0, 42.0]
    assert p.choose(120, 16400) == 1  # 1.5 / 27 now beats 1.75 / 42
    for _ in range(COST_MIN_OBS):
        p.observe_cost(128, 16000, 1, 31.0)  # the same graph (size 128, width 32768)
    # 1.5 / 31 still beats 1 / 23, but j = 0 is timed only by its graph and within
    # EXPLORE_MARGIN: it is run to be measured
    assert p.choose(120, 16400) == 0
    for _ in range(COST_MIN_OBS):
        p.observe_cost(100, 16400, 0, 23.5)
    assert p.step_costs(100, 16400) == [23.5, 31.0, 42.0]
    assert p.choose(120, 16400) == 1  # every j measured: 1.5 / 31 beats 1 / 23.5
    # the median of the last COST_WINDOW times: one outlier moves nothing
    for t in [31.0] * (COST_WINDOW - 1) + [50.0]:
        p.observe_cost(128, 16400, 1, t)
    assert p.step_costs(128, 16400)[1] == 31.0
    # times outside COST_BAND graph timings (27 ms for j = 1) are not kept at all
    for t in (27.0 * COST_BAND[1] * 1.01, 27.0 * COST_BAND[0] * 0.99):
        p.observe_cost(128, 16400, 1, t)
    assert list(p.measured[(32768, 128, 1)])[-1] == 50.0
    # shapes the policy has no graph for, and nonsense, are not recorded
    p.observe_cost(1000, 16400, 1, 5.0)
    p.observe_cost(128, 99999, 1, 5.0)
    p.observe_cost(128, 16400, 3, 5.0)
    p.observe_cost(128, 16400, 1, 0.0)
    assert set(p.measured) == {(32768, 128, j) for j in range(3)}


def test_measured_times_go_stale_and_the_shape_is_measured_again() -> None:
    p = DraftPolicy(1, decay=1.0)
    p.observe([1] * 100, [1] * 100)
    p.set_costs(_costs(1, {8: [1.0, 1.2]}))
    for _ in range(COST_MIN_OBS):
        p.observe_cost(8, 100, 1, 2.2)
    assert p.choose(8, 100) == 0  # 2 / 2.2 loses to 1 / 1
    for _ in range(COST_STALE):
        p.choose(8, 100)
    assert p.step_costs(8, 100) == [1.0, 1.2]  # forgotten: the graph timing again
    p.observe_cost(8, 100, 1, 2.1)  # a fresh window, the old times are gone
    assert list(p.measured[(1024, 8, 1)]) == [2.1]


def test_a_graph_timed_rival_close_to_the_measured_best_is_measured() -> None:
    """H100 run 83 at 128 streams x 16K, acceptance 0.5: j = 2 measured 40.4 ms, j = 0 only
    timed by its graph (25.0 ms; real steps 22.7). Before, j = 2 stayed the choice (1.75 /
    40.4 against 1 / 25.0) and lost 13% to no speculation; now j = 0 is run until measured,
    and wins."""
    p = DraftPolicy(3, decay=1.0)
    p.observe([3] * 1000, [0] * 500 + [1] * 250 + [2] * 125 + [3] * 125)  # 0.5 each
    p.set_costs(_costs(3, {128: [25.0, 38.9, 42.9, 46.6]}, width=16384 + 2048))
    for j, t in ((2, 40.4), (1, 43.0), (3, 46.6)):  # j = 1 measured slower than its graph
        for _ in range(COST_MIN_OBS):
            p.observe_cost(128, 16384, j, t)
    assert p.expected_tokens()[2] / 40.4 > 1 / 25.0  # the graph timing alone keeps j = 2
    assert (1 - EXPLORE_MARGIN) * p.expected_tokens()[2] / 40.4 <= 1 / 25.0
    assert p.choose(128, 16384) == 0  # measured first
    p.observe_cost(128, 16384, 0, 22.7)
    assert p.choose(128, 16384) == 0  # one time is not a measurement yet: still trying
    p.observe_cost(128, 16384, 0, 22.7)
    assert p.choose(128, 16384) == 0  # measured: 1 / 22.7 beats 1.75 / 40.4


def test_a_rival_whose_steps_never_land_as_its_shape_is_tried_a_few_times() -> None:
    """Exploration is bounded: a rival that yields no measurement (its steps landed as
    other shapes) is tried EXPLORE_TRIES times, then the best runs until COST_STALE."""
    p = DraftPolicy(1, decay=1.0)
    p.observe([1] * 100, [1] * 90 + [0] * 10)  # 0.9
    p.set_costs(_costs(1, {8: [1.0, 1.6]}))
    for _ in range(COST_MIN_OBS):
        p.observe_cost(8, 100, 1, 1.7)  # j = 1 measured: 1.9 / 1.7 against 1 / 1.0
    picks = [p.choose(8, 100) for _ in range(50)]
    assert picks[:EXPLORE_TRIES] == [0] * EXPLORE_TRIES and set(picks[EXPLORE_TRIES:]) == {1}
    for _ in range(COST_STALE):
        p.choose(8, 100)
    for _ in range(COST_MIN_OBS):
        p.observe_cost(8, 100, 1, 1.7)
    assert p.choose(8, 100) == 0  # a new window: tried again


def test_steps_forced_to_k_spend_no_exploration_tries() -> None:
    """While the policy measures acceptance first it runs k; a rival it would have tried
    keeps its tries for when the choice is its own."""
    p = DraftPolicy(1, prior=0.9, decay=1.0)
    p.observe([1] * 10, [1] * 9 + [0])  # evidence still thin: k is forced
    p.set_costs(_costs(1, {8: [1.0, 1.6]}))
    for _ in range(COST_MIN_OBS):
        p.observe_cost(8, 100, 1, 1.7)
    assert p._best(8, 100) == (0, (1024, 8, 0))  # the rival it would try
    assert [p.choose(8, 100) for _ in range(10)] == [1] * 10
    assert p._tries((1024, 8, 0)) == 0
    p.observe([1] * 100, [1] * 90 + [0] * 10)  # enough evidence now
    picks = [p.choose(8, 100) for _ in range(EXPLORE_TRIES + 2)]
    assert picks == [0] * EXPLORE_TRIES + [1, 1]


def test_a_size_without_measurements_scales_its_graph_timing_as_the_nearest_size_measured() -> None:
    """Run 138's shrinking batch: j = 2's graph timing is 10% optimistic at size 208; at the
    sizes the batch passes through later that j is timed by its graph scaled by the
    nearest measured size's ratio, so j = 1 stays the choice there without re-learning."""
    p = DraftPolicy(2, decay=1.0)
    p.observe([2] * 1000, [2] * 490 + [1] * 210 + [0] * 300)  # 0.7 at each position
    graph = [23.0, 35.0, 43.0]
    p.set_costs(_costs(2, {s: graph for s in (128, 160, 176, 208)}, width=16384 + 2048))
    for j, t in ((0, 23.0), (1, 34.0), (2, 47.3)):
        for _ in range(COST_MIN_OBS):
            p.observe_cost(208, 16384, j, t)
    assert p.choose(208, 16384) == 1  # 1.7 / 34 beats 2.19 / 47.3 and 1 / 23
    # size 176 has no measurements: j = 1 and j = 2 scaled by 208's ratios
    assert p.step_costs(170, 16384) == pytest.approx([23.0, 34.0, 47.3])
    assert p.choose(170, 16384) == 1  # scaled, not measured: it runs to be measured
    # the nearest measured size wins: 160 measured j = 2 at its graph timing
    for _ in range(COST_MIN_OBS):
        p.observe_cost(150, 16384, 2, 43.0)
    assert p.step_costs(170, 16384)[2] == pytest.approx(43.0)  # 160: nearer 176 than 208
    assert p.step_costs(120, 16384)[2] == pytest.approx(43.0)  # 160 is nearer 128 than 208
    # a rival timed by scaling is explored only within EXPLORE_MARGIN_SCALED
    q = DraftPolicy(1, decay=1.0)
    q.observe([1] * 100, [1] * 100)  # 1.0: j = 1 gains 2 tokens a step
    q.set_costs(_costs(1, {8: [1.0, 1.9], 16: [1.0, 1.9]}))
    for size, j, t in ((8, 0, 1.0), (16, 1, 1.9), (16, 1, 1.9)):
        q.observe_cost(size, 100, j, t)
    q.observe_cost(8, 100, 0, 1.0)
    # size 8: j = 0 measured (1 token / 1.0), j = 1 scaled by 16's ratio 1.0 (2 / 1.9)
    assert q.choose(8, 100) == 1  # the best, scaled: run to be measured
    for _ in range(COST_MIN_OBS):
        q.observe_cost(8, 100, 1, 1.9)
    # size 16: j = 1 measured, j = 0 scaled from 8 (ratio 1.0): 1 / 1.0 against 2 / 1.9 is
    # 5% behind, outside EXPLORE_MARGIN_SCALED but inside EXPLORE_MARGIN
    assert EXPLORE_MARGIN_SCALED < 1 - (1 / 1.0) / (2 / 1.9) < EXPLORE_MARGIN
    assert [q.choose(16, 100) for _ in range(3)] == [1, 1, 1]
