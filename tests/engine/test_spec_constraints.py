"""Structured output and penalties under speculative decoding: the same greedy output as
the engine without speculation (float32, CPU), with n-gram drafts on the tiny Llama, MTP
on the tiny GLM-5 and on the demo model, and with test-only drafters that propose either
the constrained continuation (every draft accepted: the grammar and the penalty counts
advance over accepted drafts inside one step) or the unconstrained one (drafts the
grammar forbids at their position, or that the penalties move away from, must be
rejected). Also the verify bitmask against matchers advanced by hand, and the
probabilistic rejection sampler never accepting a draft its row's mask forbids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _requests import assert_clean, outputs

from _drafters import OracleDrafter
from pdserve import LLM, SamplingParams
from pdserve.core_types.sampling_params import StructuredOutputsParams
from pdserve.layers.sampler import Sampler, SamplingMetadata
from pdserve.spec_decode.rejection_sampler import rejection_sample

KW: dict[str, Any] = dict(dtype="float32", block_size=4, max_num_batched_tokens=32)
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "c": {"enum": ["red", "green"]},
        "s": {"type": "string", "maxLength": 8},
    },
    "required": ["n", "c", "s"],
}
# tool_choice "required" constrains to this shape (protocol_chat.forced_tool_schema)
TOOL_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "maxItems": 1,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["get_weather"]},
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
        "required": ["name", "parameters"],
    },
}
TEXTS = ["the quick brown fox", "hello hello hello hello", "a b c a b c a b", "x y z", "go"]


def _params() -> list[SamplingParams]:
    so = StructuredOutputsParams
    return [
        SamplingParams(
            temperature=0, max_tokens=40, structured_outputs=so(json=json.dumps(SCHEMA))
        ),
        SamplingParams(
            temperature=0,
            max_tokens=30,
            ignore_eos=True,
            presence_penalty=0.5,
            frequency_penalty=0.7,
            repetition_penalty=1.2,
        ),
        SamplingParams(
            temperature=0, max_tokens=30, structured_outputs=so(regex=r"(ab|cd)+ \d{5}")
        ),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(
            temperature=0,
            max_tokens=60,
            frequency_penalty=0.4,
            structured_outputs=so(json=json.dumps(TOOL_SCHEMA)),
        ),
    ]


def _case(path: Path) -> tuple[list[list[int]], list[tuple]]:
    base = LLM(str(path), **KW)
    prompts = [base.get_tokenizer().encode(t) for t in TEXTS]
    return prompts, outputs(base, prompts, _params())


@pytest.fixture(scope="module")
def llama_case(tiny_llama: Path) -> tuple[list[list[int]], list[tuple]]:
    return _case(tiny_llama)


def _check(llm: LLM, prompts: list[list[int]], want: list[tuple]) -> None:
    got = outputs(llm, prompts, _params())
    assert got == want
    json.loads(llm.get_tokenizer().decode(got[0][0]))  # the constraints held
    st = llm.engine.stats()
    assert st.spec_num_drafts > 0
    assert_clean(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_same_greedy_output(tiny_llama: Path, llama_case, async_scheduling: bool) -> None:
    prompts, want = llama_case
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(str(tiny_llama), async_scheduling=async_scheduling, speculative_config=spec, **KW)
    _check(llm, prompts, want)
    assert llm.engine.stats().spec_num_accepted_tokens > 0


@pytest.fixture(scope="module")
def glm_case(tiny_glm5: Path) -> tuple[list[list[int]], list[tuple]]:
    return _case(tiny_glm5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mtp_same_greedy_output_tiny_glm5(
    tiny_glm5: Path, glm_case, async_scheduling: bool
) -> None:
    prompts, want = glm_case
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    llm = LLM(str(tiny_glm5), async_scheduling=async_scheduling, speculative_config=spec, **KW)
    _check(llm, prompts, want)


def test_mtp_same_greedy_output_demo_model() -> None:
    demo = Path(__file__).resolve().parents[2] / "assets" / "demo-glm5"
    prompts, want = _case(demo)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    llm = LLM(str(demo), speculative_config=spec, **KW)
    _check(llm, prompts, want)
    assert llm.engine.stats().spec_num_accepted_tokens > 0  # the trained MTP layer hits


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("constrained", [True, False])
def test_oracle_drafts_of_either_continuation(
    tiny_llama: Path, llama_case, constrained: bool, async_scheduling: bool
) -> None:
    """Drafts of the constrained continuation are all accepted (the grammar and the
    penalty counts advance over several drafts in one step); drafts of the free
    continuation (the raw model's greedy tokens) that the grammar or the penalties
    forbid are rejected. The output is the constrained one either way."""
    prompts, want = llama_case
    if constrained:
        cont = [o[0] for o in want]
    else:
        free = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        base = LLM(str(tiny_llama), **KW)
        cont = [o[0] for o in outputs(base, prompts, [free] * len(prompts))]
    seqs = {tuple(p): p + c for p, c in zip(prompts, cont, strict=True)}
    drafter = OracleDrafter(3, seqs, 512)
    llm = LLM(str(tiny_llama), proposer=drafter, async_scheduling=async_scheduling, **KW)  # type: ignore[arg-type]
    _check(llm, prompts, want)
    st = llm.engine.stats()
    if constrained:
        assert st.spec_num_accepted_tokens > 0.9 * st.spec_num_draft_tokens
    else:  # the free continuation breaks every constraint somewhere
        assert st.spec_num_accepted_tokens < st.spec_num_draft_tokens


def test_verify_bitmask_rows_follow_the_drafts(tiny_llama: Path) -> None:
    from pdserve.engine.structured_output import (
        BitmaskFiller,
        RequestGrammar,
        StructuredOutputManager,
    )
    from pdserve.frontend.tokenizer import Tokenizer

    mgr = StructuredOutputManager(tiny_llama, 512)
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    compiled = mgr.submit(spec).result()
    enc = Tokenizer.from_pretrained(tiny_llama)
    good = list(enc.encode('{"n": 1', add_special_tokens=False))
    bad = list(enc.encode("zzz", add_special_tokens=False))
    grammars: list[RequestGrammar | None] = [RequestGrammar(compiled, [2]) for _ in range(3)]
    grammars.append(None)
    drafts = [good[:3], [good[0], bad[0], good[1]], [-1, good[0]], [good[0]]]
    filler = BitmaskFiller(512)
    out = filler.fill(grammars, drafts)
    assert out.shape == (4 + 4 + 3 + 2, filler.words)

    def row(prefix: list[int]) -> np.ndarray:
        g = RequestGrammar(compiled, [2])
        for t in prefix:
            assert g.accept(t)
        return filler.fill([g])[0]

    allow_all = np.full(filler.words, -1, np.int32)
    want = [row(good[:j]) for j in range(4)]  # request 0: every draft fits
    want += [row([]), row(good[:1]), allow_all, allow_all]  # 1: past the refused draft
    want += [row([]), allow_all, allow_all]  # request 2: past a placeholder
    want += [allow_all, allow_all]  # request 3 has no grammar
    np.testing.assert_array_equal(out, np.stack(want))
    for g in grammars[:3]:  # the matchers are back where they were
        assert g is not None
        np.testing.assert_array_equal(filler.fill([g])[0], want[0])
    mgr.shutdown()


def test_probabilistic_rejection_never_accepts_a_masked_draft() -> None:
    """Row 0 puts almost all its mass on draft 5, which its grammar row forbids: the
    draft is never accepted and the emitted token is one the mask allows."""
    vocab, trials = 64, 200
    logits = torch.zeros(2, vocab)
    logits[0, 5] = 20.0
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, 10:20] = True
    allowed[1] = True
    words = torch.zeros(2, 2, dtype=torch.int64)
    for r in range(2):
        for j in torch.nonzero(allowed[r]).flatten().tolist():
            words[r, j // 32] |= 1 << (j % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    sampler = Sampler(torch.device("cpu"), seed=0)
    md = SamplingMetadata(False, torch.ones(2), None, None, None, None, {}, None, False)
    md.grammar = (torch.tensor([0, 1]), bitmask)
    for _ in range(trials):
        tokens, num = rejection_sample(
            sampler,
            logits,
            md,
            torch.tensor([[5]]),
            torch.tensor([0]),
            torch.tensor([2]),
        )
        assert int(num[0]) == 1 and 10 <= int(tokens[0, 0]) < 20


def test_a_run_is_cut_where_the_grammar_ends(tiny_llama: Path) -> None:
    """A verify may accept tokens past the one that ends the grammar (with ignore_eos the
    EOS does not stop the request): they are not fed and do not belong to the output."""
    from pdserve.engine.structured_output import RequestGrammar, StructuredOutputManager
    from pdserve.frontend.tokenizer import Tokenizer

    mgr = StructuredOutputManager(tiny_llama, 512)
    compiled = mgr.submit(StructuredOutputsParams(choice=["ab"])).result()
    ab = list(Tokenizer.from_pretrained(tiny_llama).encode("ab", add_special_tokens=False))
    g = RequestGrammar(compiled, [2])
    assert g.accept_run([*ab, 2, 7, 8]) == (len(ab) + 1, True) and g.terminated
    g = RequestGrammar(compiled, [2])
    assert g.accept_run([ab[0], 9]) == (2, False) and g.failed
    mgr.shutdown()
