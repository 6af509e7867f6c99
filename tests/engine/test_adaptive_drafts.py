"""The adaptive draft count end to end (issue 27): the scheduler verifies the policy's j in
0..k per step, a step with j = 0 runs no drafter, greedy output stays identical to the
engine without speculation while j changes under it, the choice is exported, and the
runner's timed step costs become the policy's. Costs are injected on the CPU (no
CUDA graphs to time there), with a policy whose acceptance is frozen at its prior so the
choice follows the batch size alone: a lone request verifies k drafts, two verify one,
three or four verify none."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from _requests import assert_clean, outputs, random_prompts

from _stand_in_graphs import stand_in_graphs
from pdserve import LLM, SamplingParams
from pdserve.runner.graph_costs import fill_timing_batch, time_step_costs
from pdserve.spec_decode.draft_policy import MIN_EVIDENCE, DraftPolicy

KW: dict[str, Any] = dict(dtype="float32", block_size=4, max_num_batched_tokens=16)
MAX_TOKENS = (12, 1, 9, 5)  # the batch shrinks 4 -> 3 -> 2 -> 1 as requests finish
ROWS = {1: [1.0, 1.05, 1.1, 1.15], 2: [1.0, 1.3, 1.8, 2.5], 4: [1.0, 2.0, 3.0, 4.0]}


class FrozenPolicy(DraftPolicy):
    def __init__(self, k: int, prior: float) -> None:
        super().__init__(k, prior=prior)
        # evidence enough to decide (no measuring first), at the prior's rate
        self.reached = [MIN_EVIDENCE] * (k + 1)
        self.accepted = [prior * MIN_EVIDENCE] * (k + 1)

    def observe(self, verified: Sequence[int], accepted: Sequence[int]) -> None:
        pass  # keep the prior: the choice depends on the batch alone


def _adaptive(llm: LLM, k: int) -> FrozenPolicy:
    policy = FrozenPolicy(k, prior=0.6)
    width = llm.engine.runner.max_model_len
    policy.set_costs(
        {(s, j, width): c for s, row in ROWS.items() for j, c in enumerate(row[: k + 1])}
    )
    assert [policy.choose(b) for b in (1, 2, 3, 4)] == [k, 1, 0, 0]
    llm.engine.scheduler.spec.policy = policy
    return policy


def _count_proposals(llm: LLM) -> tuple[list[int], list[tuple[int | None, bool]]]:
    """Calls of the drafter, and per call (the drafts asked for, -1 past them)."""
    calls = [0]
    asked: list[tuple[int | None, bool]] = []
    proposer = llm.engine.runner.proposer
    real = proposer.propose

    def counted(batch: Any) -> Any:
        calls[0] += 1
        out = real(batch)
        m = batch.num_drafts
        asked.append((m, m is None or bool((out[:, m:] == -1).all())))
        return out

    proposer.propose = counted  # type: ignore[method-assign]
    return calls, asked


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(("family", "spec"), [
    ("glm", {"method": "mtp", "num_speculative_tokens": 3}),
    ("llama", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
               "prompt_lookup_max": 3}),
])  # fmt: skip
def test_greedy_output_is_identical_while_the_draft_count_changes(
    tiny_glm5: Path, tiny_llama: Path, family: str, spec: dict[str, Any], async_scheduling: bool
) -> None:
    path = str(tiny_glm5 if family == "glm" else tiny_llama)
    base = LLM(path, **KW)
    prompts = random_prompts(base.engine.vocab_size, lens=(3, 21, 40, 9))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    want = outputs(base, prompts, params)
    llm = LLM(path, async_scheduling=async_scheduling, speculative_config=spec, **KW)
    _adaptive(llm, 3)
    calls, asked = _count_proposals(llm)
    assert outputs(llm, prompts, params) == want
    if family == "glm":  # a step verifying j < k drafts had MTP propose j, -1 past them
        assert {m for m, _ in asked} >= {1, 3} and all(tail for _, tail in asked)
    st = llm.engine.stats()
    by_j = st.spec_steps_by_num_drafts
    assert len(by_j) == 4 and by_j[0] > 0 and by_j[1] > 0 and by_j[3] > 0
    # a step with no drafts runs no drafter: fewer proposals than steps
    assert 0 < calls[0] <= sum(by_j[1:]) < sum(by_j)
    assert st.spec_num_draft_tokens <= 3 * st.spec_num_drafts
    assert st.spec_last_num_drafts == 3  # the last request decoded alone
    assert_clean(llm)


def test_fixed_policy_always_verifies_k_and_the_choice_is_exported(tiny_llama: Path) -> None:
    from pdserve.metrics.prometheus import PrometheusMetrics

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
            "prompt_lookup_max": 3, "draft_policy": "fixed"}  # fmt: skip
    llm = LLM(str(tiny_llama), speculative_config=spec, **KW)
    assert llm.engine.scheduler.spec.policy is None and not llm.engine.runner.adaptive_drafts
    prompts = random_prompts(llm.engine.vocab_size, lens=(5, 9))
    outputs(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 2)
    st = llm.engine.stats()
    assert st.spec_steps_by_num_drafts[:2] == [0, 0] and st.spec_steps_by_num_drafts[2] > 0
    text = PrometheusMetrics("tiny", stats_provider=lambda: st, max_model_len=128).render()[0]
    series = 'pdserve:spec_decode_steps_by_num_drafts_total{engine="0",model_name="tiny",'
    assert f'{series}num_drafts="2"}} {float(st.spec_steps_by_num_drafts[2])}' in text.decode()
    assert 'pdserve:spec_decode_num_drafts_chosen{engine="0",model_name="tiny"} 2.0' in (
        text.decode()
    )
    with pytest.raises(ValueError, match="draft_policy must be one of adaptive, fixed"):
        LLM(str(tiny_llama), speculative_config={**spec, "draft_policy": "greedy"}, **KW)


def test_timed_graph_costs_become_the_policy(tiny_glm5: Path) -> None:
    """Graphs stood in for on the CPU for every 1 + j: the runner times each key on a
    full-width synthetic batch, and the engine's policy takes those costs."""
    llm = LLM(str(tiny_glm5), speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              **KW)  # fmt: skip
    runner = llm.engine.runner
    assert runner.adaptive_drafts and runner.step_costs == {}  # no graphs: nothing timed
    assert llm.engine.scheduler.spec.policy is None  # so the engine keeps k
    g = stand_in_graphs(llm, query_lens=(1, 2, 3))
    costs = time_step_costs(g, None, runner.num_blocks)
    assert set(costs) == {(s, j, w) for s in g.sizes for j in range(3) for w in g.widths}
    assert all(c > 0 for c in costs.values())
    runner.step_costs = costs
    policy = llm.engine._draft_policy()
    assert policy is not None and policy.sizes == {w: [1, 2, 4] for w in g.widths}
    # the buffers are inert dummies again: a real step runs right after
    prompts = random_prompts(llm.engine.vocab_size, lens=(6,))
    assert outputs(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=4)])[0][0]


def test_the_timing_batch_reads_a_full_context_and_writes_nothing(tiny_glm5: Path) -> None:
    llm = LLM(str(tiny_glm5), **KW)
    buf = llm.engine.runner.buffers
    vocab = llm.engine.vocab_size
    fill_timing_batch(buf, 3, 2, 21, num_blocks=5, vocab_size=vocab)
    assert buf.seq_lens.dev[:3].tolist() == [21, 21, 21]
    ids = buf.input_ids.dev[:6]
    # tokens spread over the vocabulary (an MoE routes them as it would real ones)
    assert ids.min() >= 0 and ids.max() < vocab and len(set(ids.tolist())) > 1
    assert buf.query_start_loc.dev[:4].tolist() == [0, 2, 4, 6]
    assert buf.positions.dev[:6].tolist() == [19, 20] * 3
    assert buf.slots.dev[:6].tolist() == [0] * 6  # every token writes the null slot
    bt = buf.block_tables.dev[:3, :6]  # 21 tokens: 6 blocks of 4, over blocks 1..4
    assert bt.min() >= 1 and bt.max() <= 4 and bt[0].tolist() == [1, 2, 3, 4, 1, 2]
