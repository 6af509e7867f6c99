"""The 1+k step contract, proved with test-only drafters (tests/_drafters.py).

A drafter that proposes the target's known greedy continuation has every draft
accepted; one that proposes wrong tokens has every draft rejected. Either way greedy
output must equal the engine without speculation, token for token, in synchronous
and async scheduling, through chunked prefill, the prefix cache, preemption, stop
tokens, ``max_tokens``, ``min_tokens`` and logprobs; and the number of engine steps
falls by exactly the number of accepted drafts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _requests import assert_clean, outputs, random_prompts

from _drafters import OracleDrafter, WrongDrafter
from pdserve import LLM, SamplingParams

MAX_TOKENS = (24, 1, 7, 30, 2, 12, 5)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> tuple[list[list[int]], dict[tuple[int, ...], list[int]], int]:
    """Prompts, each prompt's greedy sequence (prompt + 64 tokens), and the vocab size."""
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4)
    vocab = llm.engine.vocab_size
    prompts = random_prompts(vocab)
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = outputs(llm, prompts, [sp] * len(prompts))
    return prompts, {tuple(p): p + o[0] for p, o in zip(prompts, outs, strict=True)}, vocab


def _spec(path: Path, drafter: type[OracleDrafter], k: int, reference, **kw: object) -> LLM:
    _, seqs, vocab = reference
    base: dict[str, object] = dict(dtype="float32", block_size=4)
    base.update(kw)
    return LLM(str(path), proposer=drafter(k, seqs, vocab), **base)  # type: ignore[arg-type]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("drafter", [OracleDrafter, WrongDrafter])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_identical_to_no_speculation(
    tiny_llama: Path, reference, drafter: type[OracleDrafter], k: int, async_scheduling: bool
) -> None:
    prompts, seqs, _ = reference
    stop_tok = seqs[tuple(prompts[0])][len(prompts[0]) + 5]  # request 0 stops mid-run
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0 if i == 2 else None
        )
        for i, m in enumerate(MAX_TOKENS)
    ]
    params[0] = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok])
    params[3] = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=9, ignore_eos=True)
    kw = dict(async_scheduling=async_scheduling, max_num_batched_tokens=16)
    base = LLM(str(tiny_llama), dtype="float32", block_size=4, **kw)  # type: ignore[arg-type]
    want = outputs(base, prompts, params)
    spec = _spec(tiny_llama, drafter, k, reference, **kw)
    assert outputs(spec, prompts, params) == want
    assert outputs(spec, prompts, params) == want  # again, through the prefix cache
    st = spec.engine.stats()
    assert st.prefix_cache_hits > 0 and st.spec_num_drafts > 0
    if drafter is WrongDrafter:
        assert st.spec_num_accepted_tokens == 0
    else:
        assert st.spec_num_accepted_tokens > 0
    assert sum(st.spec_num_accepted_tokens_per_pos) == st.spec_num_accepted_tokens
    assert len(st.spec_num_accepted_tokens_per_pos) <= k
    # logprobs of accepted drafts equal the plain engine's
    lp = spec.generate([{"prompt_token_ids": prompts[2]}], params[2])[0].outputs[0].logprobs
    lp_base = base.generate([{"prompt_token_ids": prompts[2]}], params[2])[0].outputs[0].logprobs
    assert lp is not None and lp_base is not None
    torch.testing.assert_close(torch.tensor(lp), torch.tensor(lp_base), rtol=1e-5, atol=1e-5)
    assert_clean(spec)


@pytest.mark.parametrize("drafter", [OracleDrafter, WrongDrafter])
def test_a_row_handed_over_while_its_last_verify_is_in_flight(
    tiny_llama: Path, reference, drafter: type[OracleDrafter]
) -> None:
    """Async scheduling, two rows for seven requests: a request admitted into the row of
    one that just finished is prepared while that request's last (discarded) verify is
    still in flight. The new request's positions must not be moved back by the drafts
    the old one had rejected (the in-flight step's row data belongs to another request)."""
    prompts, seqs, _ = reference
    # each stops on a sampled token (not at a length the scheduler sees coming), so its
    # row is handed over while the step after its stop is still in flight
    params = [
        SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[seqs[tuple(p)][len(p) + m]])
        for p, m in zip(prompts, MAX_TOKENS, strict=True)
    ]
    kw = dict(async_scheduling=True, max_num_seqs=2)
    want = outputs(LLM(str(tiny_llama), dtype="float32", block_size=4, **kw), prompts, params)  # type: ignore[arg-type]
    spec = _spec(tiny_llama, drafter, 3, reference, **kw)
    assert outputs(spec, prompts, params) == want
    assert_clean(spec)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_small_pool(tiny_llama: Path, reference, async_scheduling: bool) -> None:
    prompts, _, _ = reference
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    kw = dict(
        async_scheduling=async_scheduling, num_gpu_blocks_override=20, enable_prefix_caching=False
    )
    base = LLM(str(tiny_llama), dtype="float32", block_size=4, **kw)  # type: ignore[arg-type]
    want = outputs(base, prompts, params)
    spec = _spec(tiny_llama, OracleDrafter, 3, reference, **kw)
    assert outputs(spec, prompts, params) == want
    assert spec.engine.stats().num_preemptions > 0
    assert_clean(spec)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("drafter", [OracleDrafter, WrongDrafter])
def test_steps_fall_by_the_accepted_count(
    tiny_llama: Path, reference, drafter: type[OracleDrafter], async_scheduling: bool
) -> None:
    prompts, _, _ = reference
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = LLM(str(tiny_llama), dtype="float32", block_size=4, async_scheduling=async_scheduling)
    spec = _spec(tiny_llama, drafter, 3, reference, async_scheduling=async_scheduling)
    for p in prompts[:3]:  # one request at a time: each step is that request's
        s0, n0 = base.engine.stats().num_steps, spec.engine.stats().num_steps
        a0 = spec.engine.stats().spec_num_accepted_tokens
        assert outputs(spec, [p], [sp]) == outputs(base, [p], [sp])
        steps_base = base.engine.stats().num_steps - s0
        steps_spec = spec.engine.stats().num_steps - n0
        accepted = spec.engine.stats().spec_num_accepted_tokens - a0
        assert steps_base == 40
        assert steps_spec == steps_base - accepted
        if drafter is OracleDrafter:
            # every verify emits 4 tokens (3 drafts + 1), the last one what is left
            assert accepted == 39 - -(-39 // 4)
        else:
            assert accepted == 0


def test_placeholders_are_never_accepted(tiny_llama: Path, reference) -> None:
    """A drafter with nothing to propose returns -1: those slots are computed and
    always rejected, even where the target would emit token 0 (the placeholder's
    stand-in id)."""

    class NoDrafts(OracleDrafter):
        def propose(self, batch):  # type: ignore[no-untyped-def]
            return torch.full(
                (len(batch.req_ids), self.num_speculative_tokens), -1, device=batch.sampled.device
            )

    prompts, _, _ = reference
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = LLM(str(tiny_llama), dtype="float32", block_size=4)
    spec = _spec(tiny_llama, NoDrafts, 2, reference)
    verified = []
    schedule = spec.engine.scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        so = schedule()
        verified.extend(d for ds in so.scheduled_spec_decode_tokens.values() for d in ds)
        return so

    spec.engine.scheduler.schedule = spy  # type: ignore[method-assign]
    assert outputs(spec, prompts, [sp] * len(prompts)) == outputs(
        base, prompts, [sp] * len(prompts)
    )
    assert verified and set(verified) == {-1}  # the slots were computed
    st = spec.engine.stats()
    # and none counts as a draft (the drafter proposed nothing) or was accepted
    assert st.spec_num_draft_tokens == 0 and st.spec_num_accepted_tokens == 0


def test_runner_returns_hidden_states_of_every_scheduled_token(tiny_llama: Path, reference) -> None:
    """The drafter sees the final hidden state of every token the step computed: the
    same rows a plain forward of the prompt gives."""
    seen: list[torch.Tensor] = []

    class Spy(OracleDrafter):
        def propose(self, batch):  # type: ignore[no-untyped-def]
            seen.append(batch.hidden.clone())
            return super().propose(batch)

    prompts, _, _ = reference
    spec = _spec(tiny_llama, Spy, 2, reference)
    spec.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(temperature=0, max_tokens=2))
    model = spec.engine.runner.model
    from _attn_helper import PagedKV

    kv = PagedKV(model, 1, 32)
    ids = torch.tensor(prompts[1])
    with torch.no_grad(), kv.step([0], [len(ids)]):
        want = model(ids, torch.arange(len(ids)))
    torch.testing.assert_close(seen[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_uniform_verify_batches_replay_graphs(
    tiny_llama: Path, reference, async_scheduling: bool
) -> None:
    """On CUDA, uniform batches of 1+k tokens per request replay their (batch, 1+k)
    graph, and the outputs still equal the plain engine's."""
    prompts, _, _ = reference
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 4
    kw = dict(
        device="cuda",
        async_scheduling=async_scheduling,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    base = LLM(str(tiny_llama), dtype="float32", block_size=4, **kw)  # type: ignore[arg-type]
    want = outputs(base, prompts[:4], params)
    spec = _spec(tiny_llama, OracleDrafter, 3, reference, **kw)
    graphs = spec.engine.runner.graphs
    assert graphs is not None
    # keys (padded size, q, width): a Llama asks for no narrower width than max_model_len
    w = spec.engine.runner.max_model_len
    assert graphs.widths == [w]
    # adaptive drafting (the default) verifies any 1 + j, j in 0..3: a graph for each
    qs = range(1, 5) if spec.engine.runner.adaptive_drafts else (1, 4)
    assert set(graphs.graphs) == {(s, q, w) for q in qs for s in (1, 2, 4, 8)}
    assert outputs(spec, prompts[:4], params) == want
    st = spec.engine.stats()
    assert st.step_paths.get("graph", 0) >= 4 and st.spec_num_accepted_tokens > 0
