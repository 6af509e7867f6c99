"""Sync and async scheduling (step pipeline depth 0 and 1) give the same tokens, with
everything that reads the request state on the device at once: the tiny Llama without
speculation and with n-gram drafts, the tiny GLM-5 with MTP drafts; greedy and seeded
requests, penalties, structured output (regex and JSON schema), and a KV pool small
enough that requests are preempted and resumed (rows handed to other requests while
their last step is in flight; with drafts, for the greedy requests: see below). (Each feature alone: test_async_scheduling.py,
test_speculative.py, test_spec_constraints.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _requests import assert_clean, outputs

from pdserve import LLM, SamplingParams
from pdserve.core_types.sampling_params import StructuredOutputsParams

KW: dict[str, Any] = dict(
    dtype="float32",
    block_size=4,
    max_num_batched_tokens=24,
    enable_prefix_caching=False,
)
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
}
TEXTS = ["the quick brown fox", "hello hello hello", "a b c a b c a b", "x y z", "go", "one two"]


GREEDY, SEEDED = (0, 1, 4), (2, 3, 5)


def _params() -> list[SamplingParams]:
    so = StructuredOutputsParams
    pen = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2)
    return [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **pen),  # type: ignore[arg-type]
        SamplingParams(temperature=0.9, top_k=30, seed=7, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=14, ignore_eos=True, **pen),  # type: ignore[arg-type]
        SamplingParams(
            temperature=0, max_tokens=16, structured_outputs=so(regex=r"(ab|cd)+ \d{4}")
        ),
        SamplingParams(
            temperature=0.7, seed=3, max_tokens=20, structured_outputs=so(json=json.dumps(SCHEMA))
        ),
    ]


CASES = {
    "llama": ("tiny_llama", None),
    "llama-ngram": ("tiny_llama", {"method": "ngram", "num_speculative_tokens": 3}),
    "glm5-mtp": ("tiny_glm5", {"method": "mtp", "num_speculative_tokens": 2}),
}


def _same_in_both_modes(
    path: Path, pick: tuple[int, ...], drafts_accepted: bool = False, **kw: Any
) -> None:
    got = {}
    for mode in (False, True):
        llm = LLM(str(path), async_scheduling=mode, **kw)
        texts = [TEXTS[i] for i in pick]
        prompts = [llm.get_tokenizer().encode(t) for t in texts]
        got[mode] = outputs(llm, prompts, [_params()[i] for i in pick])
        st = llm.engine.stats()
        assert st.num_preemptions > 0 or "num_gpu_blocks_override" not in kw, mode
        if drafts_accepted:
            assert st.spec_num_accepted_tokens > 0, mode
        assert_clean(llm)
    assert got[True] == got[False]
    assert all(toks for toks, _, _ in got[False])


@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_and_async_give_the_same_tokens(case: str, request: pytest.FixtureRequest) -> None:
    fixture, spec = CASES[case]
    path: Path = request.getfixturevalue(fixture)
    if spec is None:
        _same_in_both_modes(path, GREEDY + SEEDED, **KW, num_gpu_blocks_override=12)
        return
    kw = {**KW, "speculative_config": spec}
    _same_in_both_modes(path, GREEDY, case == "llama-ngram", **kw, num_gpu_blocks_override=12)
    # seeded sampling with drafts, without preemption: a resumed request replays one
    # draw of its generator per output token, while a verify draws one per logits row,
    # so where a request is preempted (which differs by mode) would move its stream
    _same_in_both_modes(path, SEEDED, **kw)
