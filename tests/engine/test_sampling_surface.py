"""The sampling surface beyond temperature and filters, on the offline API over the tiny
Llama: top-N logprobs (against transformers' log_softmax of the same checkpoint),
``logit_bias`` and ``allowed_token_ids`` (greedy, random, and speculative verify rows),
the sampler's mask against a torch reference, and ``bad_words``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.layers.sampler import Sampler, SamplingMetadata, top_logprobs

KW: dict[str, Any] = dict(dtype="float32", block_size=4, max_num_batched_tokens=32)
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), **KW)


def _greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_top_logprobs_match_transformers(llm: LLM, tiny_llama: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = llm.generate(PROMPT, _greedy(6, logprobs=5))[0]
    c = out.outputs[0]
    assert c.logprobs is not None and c.top_logprobs is not None
    assert len(c.top_logprobs) == len(c.token_ids) == 6
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_llama), torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.tensor([out.prompt_token_ids + c.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    p = len(out.prompt_token_ids)
    ref = logits[p - 1 : p - 1 + len(c.token_ids)].log_softmax(-1)
    for j, (tok, lp, top) in enumerate(zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True)):
        want_lp, want_ids = ref[j].topk(5)
        assert list(top) == want_ids.tolist()
        assert torch.allclose(torch.tensor(list(top.values())), want_lp, atol=1e-4)
        assert lp == pytest.approx(ref[j, tok].item(), abs=1e-4)
        assert tok == next(iter(top))  # greedy: the sampled token is the most likely one


def test_top_logprobs_per_request_n_and_logprobs_zero(llm: LLM) -> None:
    outs = llm.generate(
        [PROMPT, PROMPT, PROMPT],
        [_greedy(4, logprobs=2), _greedy(4, logprobs=0), _greedy(4, logprobs=20)],
    )
    a, b, c = (o.outputs[0] for o in outs)
    assert a.top_logprobs is not None and all(len(t) == 2 for t in a.top_logprobs)
    assert b.top_logprobs is None and b.logprobs is not None and len(b.logprobs) == 4
    assert c.top_logprobs is not None and all(len(t) == 20 for t in c.top_logprobs)
    assert a.token_ids == b.token_ids == c.token_ids
    for short, long in zip(a.top_logprobs, c.top_logprobs, strict=True):
        assert list(short) == list(long)[:2]


def test_top_logprobs_with_speculative_decoding(tiny_llama: Path, llm: LLM) -> None:
    want = llm.generate(PROMPT, _greedy(12, logprobs=3))[0].outputs[0]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    sllm = LLM(str(tiny_llama), speculative_config=spec, **KW)
    got = sllm.generate(PROMPT, _greedy(12, logprobs=3))[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert got.top_logprobs is not None and want.top_logprobs is not None
    for g, w in zip(got.top_logprobs, want.top_logprobs, strict=True):
        assert list(g) == list(w)
        assert list(g.values()) == pytest.approx(list(w.values()), abs=1e-4)


def test_logit_bias_forces_a_token_in_greedy(llm: LLM) -> None:
    free = llm.generate(PROMPT, _greedy(5))[0].outputs[0]
    target = next(t for t in range(3, 50) if t not in free.token_ids)
    out = llm.generate(PROMPT, _greedy(5, logit_bias={target: 100.0}))[0].outputs[0]
    assert out.token_ids == [target] * 5
    # a strong negative bias on the greedy choice moves the first token off it
    out = llm.generate(PROMPT, _greedy(1, logit_bias={free.token_ids[0]: -100.0}))[0]
    assert out.outputs[0].token_ids[0] != free.token_ids[0]


def test_allowed_token_ids_restrict_greedy_and_random(llm: LLM) -> None:
    allowed = [5, 17, 40]
    outs = llm.generate(
        [PROMPT, PROMPT],
        [
            _greedy(8, allowed_token_ids=allowed),
            SamplingParams(
                temperature=1.5, seed=3, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed
            ),  # fmt: skip
        ],
    )
    for o in outs:
        assert set(o.outputs[0].token_ids) <= set(allowed)


def test_bias_and_allowed_apply_to_every_verify_row(tiny_llama: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    sllm = LLM(str(tiny_llama), speculative_config=spec, **KW)
    out = sllm.generate(PROMPT, _greedy(10, logit_bias={7: 100.0}))[0].outputs[0]
    assert out.token_ids == [7] * 10
    allowed = [9, 11]
    out = sllm.generate(PROMPT, _greedy(10, allowed_token_ids=allowed))[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    stats = sllm.engine.stats()
    assert stats.num_steps < stats.num_generated_tokens  # drafts were verified and accepted


def _md(r: int, **kw: Any) -> SamplingMetadata:
    base: dict[str, Any] = dict(
        all_greedy=False,
        temperature=torch.ones(r),
        greedy_rows=None,
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
        banned=None,
        need_logprobs=False,
    )
    base.update(kw)
    return SamplingMetadata(**base)


def test_masked_matches_a_torch_reference() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    bias = (torch.tensor([0, 0, 2]), torch.tensor([1, 4, 4]), torch.tensor([2.0, -3.0, 5.0]))
    allowed = (torch.tensor([False, True, False]), torch.tensor([1, 1]), torch.tensor([3, 6]))
    banned = (torch.tensor([2]), torch.tensor([0]))
    got = Sampler(torch.device("cpu")).masked(
        logits, _md(3, bias=bias, allowed=allowed, banned=banned)
    )
    want = logits.clone()
    want[0, 1] += 2.0
    want[0, 4] -= 3.0
    want[2, 4] += 5.0
    keep = torch.zeros(10, dtype=torch.bool)
    keep[[3, 6]] = True
    want[1, ~keep] = float("-inf")
    want[2, 0] = float("-inf")
    assert torch.equal(got, want)


def test_random_sampling_with_bias_follows_the_biased_distribution() -> None:
    torch.manual_seed(1)
    v, r = 6, 4000
    row = torch.randn(v)
    logits = row.expand(r, v).contiguous()
    ids = torch.tensor([2, 5])
    vals = torch.tensor([1.5, -2.0])
    rows = torch.arange(r).repeat_interleave(2)
    md = _md(r, bias=(rows, ids.repeat(r), vals.repeat(r)))
    sampled, _ = Sampler(torch.device("cpu"), seed=5)(logits, md)
    freq = torch.bincount(sampled, minlength=v).float() / r
    ref = row.clone()
    ref[ids] += vals
    assert torch.allclose(freq, ref.softmax(-1), atol=0.03)


def test_top_logprobs_helper_is_log_softmax_topk() -> None:
    logits = torch.randn(5, 30)
    ids, lps = top_logprobs(logits, 4)
    want_lps, want_ids = logits.log_softmax(-1).topk(4)
    assert torch.equal(ids, want_ids) and torch.allclose(lps, want_lps)


def _penalised_greedy_reference(
    model: Any, prompt: list[int], n: int, presence: float, frequency: float, repetition: float
) -> list[int]:
    """Greedy decoding with vLLM's penalty formulas applied to transformers' logits."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.numel())
        counts = counts[: logits.numel()].float()
        seen = counts > 0
        seen[torch.tensor(prompt)] = True
        logits = torch.where(
            seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits
        )
        logits = logits - frequency * counts - presence * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_match_a_torch_reference(tiny_llama: Path, async_scheduling: bool) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_llama), torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    eng = LLM(str(tiny_llama), async_scheduling=async_scheduling, **KW)
    prompt = eng.get_tokenizer().encode(PROMPT)
    cases = [(0.0, 1.5, 1.0), (1.0, 0.0, 1.0), (0.0, 0.0, 1.8), (0.5, 0.3, 1.3), (-0.5, 0.0, 0.7)]
    params = [
        _greedy(10, presence_penalty=pp, frequency_penalty=fp, repetition_penalty=rp)
        for pp, fp, rp in cases
    ]
    plain = _greedy(10)
    # one batch: penalised rows beside a plain one
    outs = eng.generate([{"prompt_token_ids": prompt}] * (len(cases) + 1), [*params, plain])
    for (pp, fp, rp), o in zip(cases, outs, strict=False):
        want = _penalised_greedy_reference(model, prompt, 10, pp, fp, rp)
        assert o.outputs[0].token_ids == want, (pp, fp, rp)
    assert outs[-1].outputs[0].token_ids == _penalised_greedy_reference(
        model, prompt, 10, 0.0, 0.0, 1.0
    )


def test_large_frequency_penalty_prevents_repeats(llm: LLM) -> None:
    free = llm.generate(PROMPT, _greedy(12))[0].outputs[0].token_ids
    assert len(set(free)) < len(free)  # the tiny model loops
    out = llm.generate(PROMPT, _greedy(12, frequency_penalty=2.0, presence_penalty=2.0))
    toks = out[0].outputs[0].token_ids
    assert len(set(toks)) > len(set(free))


def test_bad_words_are_refused_with_speculative_decoding(tiny_llama: Path) -> None:
    """(Penalties with speculative decoding: tests/engine/test_spec_constraints.py.)"""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    sllm = LLM(str(tiny_llama), speculative_config=spec, **KW)
    with pytest.raises(ValueError, match="bad_words with speculative decoding"):
        sllm.generate(PROMPT, _greedy(4, bad_words=["a"]))


def test_bad_words_single_and_multi_token(llm: LLM) -> None:
    free = llm.generate(PROMPT, _greedy(30))[0].outputs[0].text
    word = max(set(free.split()), key=free.split().count)  # what greedy repeats
    assert f"{word} {word}" in free
    # a two-token word: its second token is banned right after its first
    two = llm.generate(PROMPT, _greedy(30, bad_words=[f"{word} {word}"]))[0].outputs[0].text
    assert f"{word} {word}" not in two and two != free
    # a one-token word (as is and after a space): never generated
    one = llm.generate(PROMPT, _greedy(30, bad_words=[word]))[0].outputs[0]
    single = {s[0] for s in llm.processor.bad_word_sequences([word]) if len(s) == 1}
    assert single and not single & set(one.token_ids)
