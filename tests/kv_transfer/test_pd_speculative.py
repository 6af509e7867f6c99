"""Speculative decoding across a P/D hand-off (in-process engines, tcp on loopback).

The prefill instance drafts k=1 and the decode instance k=3 (per-pool depth, as in
examples/4p1d-glm5.yaml). With MTP the prefill runs the MTP layer over the prompt, so
the MTP layer's caches travel with the target's (one more layer in the same cache
groups); the decode instance recomputes the last prompt token, and with padding its
first step verifies k placeholders (never accepted) so it has the (1+k)-token shape of
every other decode step. Greedy output equals the colocated engine without speculation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _pd_engines import PROMPTS, engine, handoff_error, prefill, proc, run, settle, tokens
from pdserve import LLM, SamplingParams
from pdserve.core_types.sampling_params import StructuredOutputsParams

SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _reference(path: Path, sps: list[SamplingParams] | None = None) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", block_size=4)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sps or SP)]  # type: ignore[arg-type]


def _pd_run(path: Path, p_spec: dict, d_spec: dict, async_scheduling: bool, sps=None):  # type: ignore[no-untyped-def, type-arg]
    p = engine(path, "kv_producer", speculative_config=p_spec)
    d = engine(path, "kv_consumer", speculative_config=d_spec, async_scheduling=async_scheduling)
    pp, dp = proc(p, path), proc(d, path)
    try:
        for i, ids in enumerate(PROMPTS):
            params = prefill(p, pp, f"r{i}", ids)
            # the prompt's blocks only, not the lookahead slots MTP drafting reserved
            assert len(params.remote_block_ids or []) == -(-len(ids) // 4)
            d.add_request(dp.make_request(f"r{i}", ids, sps[i] if sps else SP, params))
        outs = run(d, {f"r{i}" for i in range(len(PROMPTS))}, limit=90.0)  # a shared CPU
        got = [tokens(outs[f"r{i}"]) for i in range(len(PROMPTS))]
        st = d.stats()
        assert st.kv_transfer_failures == 0
        assert st.prompt_tokens_by_source["external_kv_transfer"] == sum(
            len(x) - 1 for x in PROMPTS
        )
        settle(p, d)
        return got, st
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize(("pad", "async_scheduling"), [(True, True), (False, False), (True, False)])
def test_mtp_1p1d_greedy_output_is_identical(
    tiny_glm5: Path, pad: bool, async_scheduling: bool
) -> None:
    want = _reference(tiny_glm5)
    p_spec = {"method": "mtp", "num_speculative_tokens": 1}
    d_spec = {"method": "mtp", "num_speculative_tokens": 3, "pad_first_decode_step": pad}
    got, st = _pd_run(tiny_glm5, p_spec, d_spec, async_scheduling)
    assert got == want
    # every request's first decode step was padded (or none was), and the padding is
    # not counted as drafts: each counted verify carried real drafts
    assert st.spec_num_padded_steps == (len(PROMPTS) if pad else 0)
    assert st.spec_num_drafts > 0 and st.spec_num_draft_tokens <= 3 * st.spec_num_drafts


def test_ngram_1p1d_greedy_output_is_identical(tiny_llama: Path) -> None:
    want = _reference(tiny_llama)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    got, st = _pd_run(tiny_llama, {**spec, "num_speculative_tokens": 1}, spec, True)
    assert got == want
    assert st.spec_num_padded_steps == len(PROMPTS)
    assert sum(st.spec_num_accepted_tokens_per_pos) == st.spec_num_accepted_tokens


def _constrained() -> list[SamplingParams]:
    """One per prompt: a JSON schema, penalties, a regex, a forced tool call's shape
    with a penalty, and a choice."""
    so = StructuredOutputsParams
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}},
        "required": ["n", "s"],
    }
    calls = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "properties": {"name": {"enum": ["f"]}, "parameters": {"type": "object"}},
            "required": ["name", "parameters"],
        },
    }
    return [
        SamplingParams(
            temperature=0, max_tokens=30, structured_outputs=so(json=json.dumps(schema))
        ),
        SamplingParams(
            temperature=0,
            max_tokens=12,
            ignore_eos=True,
            presence_penalty=0.4,
            frequency_penalty=0.6,
        ),
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=so(regex=r"(ab|c)+\d{3}")),
        SamplingParams(
            temperature=0,
            max_tokens=30,
            repetition_penalty=1.3,
            structured_outputs=so(json=json.dumps(calls)),
        ),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=so(choice=["yes", "no"])),
    ]


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_constraints_and_penalties_across_the_handoff(
    tiny_glm5: Path, tiny_llama: Path, method: str
) -> None:
    """The decode instance samples the first token itself (the prefill's is dropped), so
    its grammar starts at the hand-off; with drafting on the decode side the constrained
    and penalised greedy output is the colocated engine's without speculation."""
    path = tiny_glm5 if method == "mtp" else tiny_llama
    sps = _constrained()
    want = _reference(path, sps)
    spec: dict = {"method": method, "num_speculative_tokens": 3}  # type: ignore[type-arg]
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    got, st = _pd_run(path, {**spec, "num_speculative_tokens": 1}, spec, True, sps)
    assert got == want
    assert st.spec_num_drafts > 0


def test_speculative_method_mismatch_is_refused(tiny_llama: Path) -> None:
    p = engine(
        tiny_llama,
        "kv_producer",
        speculative_config={"method": "ngram", "num_speculative_tokens": 1},
    )
    d = engine(tiny_llama, "kv_consumer")
    assert "speculative_config" in handoff_error(p, d, tiny_llama)
