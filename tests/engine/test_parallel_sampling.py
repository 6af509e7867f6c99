"""``n`` > 1 and ``prompt_logprobs`` on the offline API over the tiny checkpoints: the
prompt logprobs equal transformers' teacher-forced log-softmax (chunked prefill, top-N,
ranks, batched with other requests, a warm prefix cache skipped), also with n-gram
speculative decoding and on the tiny GLM-5; n samples share the prompt's blocks, are
reproducible with a seed and equal when greedy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.frontend.outputs import PromptLogprobList
from pdserve.runner.prompt_logprobs import PromptLogprobsPlan, score_prompt_rows

# chunks of 16 tokens: a 40-token prompt takes three steps
KW: dict[str, Any] = dict(dtype="float32", block_size=4, max_num_batched_tokens=16)
PROMPT = list(range(7, 47))


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), **KW)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> torch.Tensor:
    """transformers' log-softmax at each position of PROMPT (row j scores token j+1)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_llama), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)


def _check(
    plp: PromptLogprobList | None, ids: list[int], ref: torch.Tensor, n: int, tol: float = 1e-4
) -> None:
    """vLLM's shape: None, then per position the actual token (first, with its rank)
    and the top-n (ranks 1..n), all equal to the reference log-softmax."""
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry, row = plp[p], ref[p - 1]
        assert entry is not None
        assert next(iter(entry)) == ids[p]
        actual = entry[ids[p]]
        assert actual.logprob == pytest.approx(row[ids[p]].item(), abs=tol)
        assert actual.rank == int((row >= row[ids[p]]).sum())
        want_lps, want_ids = row.topk(n)
        assert set(entry) == {ids[p], *want_ids.tolist()}
        for r, (t, v) in enumerate(zip(want_ids.tolist(), want_lps.tolist(), strict=True)):
            assert entry[t].logprob == pytest.approx(v, abs=tol)
            if t != ids[p]:
                assert entry[t].rank == r + 1


def _greedy(max_tokens: int = 3, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_prompt_logprobs_match_transformers(llm: LLM, reference: torch.Tensor) -> None:
    """Chunked across three steps, batched with requests that ask for other N or none,
    and on a prompt whose blocks are already cached (they are skipped, not reused)."""
    plain = _greedy()
    warm = llm.generate({"prompt_token_ids": PROMPT}, plain)[0]  # caches the prompt
    outs = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 3 + [{"prompt_token_ids": PROMPT[:9]}],
        [
            _greedy(prompt_logprobs=5),
            _greedy(prompt_logprobs=0),
            plain,
            _greedy(prompt_logprobs=20),
        ],
    )
    five, zero, none, short = outs
    assert five.num_cached_tokens == 0 and zero.num_cached_tokens == 0
    assert none.num_cached_tokens > 0 and none.prompt_logprobs is None
    _check(five.prompt_logprobs, PROMPT, reference, 5)
    _check(zero.prompt_logprobs, PROMPT, reference, 0)
    _check(short.prompt_logprobs, PROMPT[:9], reference, 20)  # causal: a prefix's rows
    # the outputs themselves are unchanged by asking
    assert five.outputs[0].token_ids == warm.outputs[0].token_ids == none.outputs[0].token_ids


def test_one_token_prompt_has_only_none(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": [5]}, _greedy(prompt_logprobs=2))[0]
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_with_speculative_decoding(
    tiny_llama: Path, reference: torch.Tensor
) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    sllm = LLM(str(tiny_llama), speculative_config=spec, **KW)
    out = sllm.generate({"prompt_token_ids": PROMPT}, _greedy(8, prompt_logprobs=3))[0]
    _check(out.prompt_logprobs, PROMPT, reference, 3)


def test_scoring_in_pieces_equals_one_piece() -> None:
    """The bounded pieces a long chunk is scored in give what one piece gives."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=g)
    weight = torch.randn(50, 8, generator=g)
    plan = PromptLogprobsPlan(
        req_ids=["a"],
        starts=[1],
        counts=[9],
        offsets=[0],
        ns=[4],
        num_top=4,
        token_index=torch.tensor([0, 1, 2, 3, 5, 6, 7, 8, 10]),
        targets=torch.randint(0, 50, (9,), generator=g),
    )
    whole = score_prompt_rows(hidden, plan, lambda h: h @ weight.T, max_rows=64)
    parts = score_prompt_rows(hidden, plan, lambda h: h @ weight.T, max_rows=2)
    assert torch.allclose(whole[0], parts[0]) and torch.allclose(whole[3], parts[3])
    assert torch.equal(whole[1], parts[1]) and torch.equal(whole[2], parts[2])
    ref = (hidden[plan.token_index] @ weight.T).log_softmax(-1)
    assert torch.allclose(whole[0], ref.gather(1, plan.targets[:, None]).squeeze(1))
    assert torch.equal(whole[2], ref.topk(4).indices)


def test_n_samples_share_the_prompt_blocks(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    prompt = list(range(60, 90))  # 30 tokens: 7 full blocks before the last token
    before = kv.prefix_hits
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, max_tokens=4, seed=5))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert kv.prefix_hits - before == 2 * 28  # the two siblings hit choice 0's blocks
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the samples differ
    again = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, max_tokens=4, seed=5))
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in out.outputs]
    # sample i is the single request seeded seed + i
    one = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, seed=7))[0]
    assert one.outputs[0].token_ids == out.outputs[2].token_ids
    greedy = llm.generate({"prompt_token_ids": prompt}, _greedy(4, n=3))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


def test_n_with_prompt_logprobs_computes_the_prompt_once(llm: LLM, reference: torch.Tensor) -> None:
    """Choice 0 computes the whole prompt for its logprobs; its siblings hit its blocks."""
    kv = llm.engine.scheduler.kv
    assert kv.reset_prefix_cache()
    before = kv.prefix_hits
    out = llm.generate({"prompt_token_ids": PROMPT}, _greedy(3, n=2, prompt_logprobs=2))[0]
    _check(out.prompt_logprobs, PROMPT, reference, 2)
    assert kv.prefix_hits - before == 36  # (40 - 1) // 4 blocks of 4


def test_prompt_logprobs_on_tiny_glm5(tiny_glm5: Path) -> None:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GlmMoeDsaForCausalLM"):
        pytest.skip("this transformers has no GlmMoeDsa")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_glm5), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt = torch.randint(3, 1000, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    glm = LLM(str(tiny_glm5), dtype="float32", block_size=4, max_num_batched_tokens=16)
    out = glm.generate({"prompt_token_ids": prompt}, _greedy(2, prompt_logprobs=3))[0]
    _check(out.prompt_logprobs, prompt, ref, 3, tol=1e-3)
