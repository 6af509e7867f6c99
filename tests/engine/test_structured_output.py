"""Structured output in the engine: the bitmask applied on the device against a
per-token reference, the offline engine under async scheduling (masks deferred: the
next step's forward is launched before the step in flight lands and the matchers
advance; the same tokens as landing first), a grammar that fails to compile, an abort
while compiling. (With speculative decoding: test_spec_constraints.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.core_types.sampling_params import StructuredOutputsParams
from pdserve.layers.sampler import Sampler, SamplingMetadata, unpack_bitmask

KW: dict[str, Any] = dict(dtype="float32", block_size=4, max_model_len=256)
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "c": {"enum": ["red", "green"]},
    },
    "required": ["n", "c"],
}


def test_bitmask_masks_exactly_the_forbidden_ids() -> None:
    g = torch.Generator().manual_seed(0)
    vocab, rows = 70, 3  # 70 ids: three 32-bit words, the last one partly used
    allowed = torch.rand(rows, vocab, generator=g) < 0.3
    words = torch.zeros(rows, 3, dtype=torch.int64)
    for r in range(rows):
        for j in range(vocab):
            if allowed[r, j]:
                words[r, j // 32] |= 1 << (j % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(unpack_bitmask(bitmask, vocab), allowed)

    logits = torch.randn(5, vocab, generator=g)
    md = SamplingMetadata(True, None, None, None, None, None, {}, None, False)
    md.grammar = (torch.tensor([0, 2, 4]), bitmask)
    out = Sampler(torch.device("cpu")).masked(logits, md)
    for i, row in enumerate([0, 2, 4]):
        ref = logits[row].masked_fill(~allowed[i], float("-inf"))
        assert torch.equal(out[row], ref)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), **KW)


def _so(**kw: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def _mixed_params() -> list[SamplingParams]:
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=so)
        for i, so in enumerate(
            [
                _so(json=json.dumps(SCHEMA)),
                _so(json=json.dumps(SCHEMA)),
                _so(regex=r"\d{3}-[ab]"),
                _so(choice=["left", "right turn"]),
                None,
                _so(grammar='root ::= "(" ("x" | "y")+ ")"'),
            ]
        )
    ]
    params[4].ignore_eos = True
    params[4].bad_words = ["a b", "c"]  # bans that depend on the tokens in flight too
    return params


def test_offline_constraints_mixed_with_free_requests(llm: LLM) -> None:
    assert llm.config.scheduler.async_scheduling and llm.engine.scheduler.defer_masks
    params = _mixed_params()
    outs = [o.outputs[0] for o in llm.generate(["go"] * len(params), params)]
    for c in outs[:2]:
        obj = json.loads(c.text)
        assert c.finish_reason == "stop" and set(obj) == {"n", "c"} and 0 <= obj["n"] <= 99
    assert re.fullmatch(r"\d{3}-[ab]", outs[2].text)
    assert outs[3].text in ("left", "right turn")
    assert len(outs[4].token_ids) == 60  # the free request runs on, beside them
    assert outs[5].finish_reason in ("stop", "length") and re.fullmatch(r"\([xy]+\)?", outs[5].text)


def test_deferred_masks_give_the_tokens_of_landing_first(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deferred masks (forward launched, then the step in flight lands, then the masks
    are filled) sample exactly what the land-first order samples, and they are taken:
    constrained requests are scheduled while their previous step is in flight."""
    sched = llm.engine.scheduler
    deferred: list[int] = []
    real = type(sched).fill_masks

    def spy(self, so):  # type: ignore[no-untyped-def]
        if so.masks_deferred:
            deferred.append(len(so.structured_req_ids))
        return real(self, so)

    monkeypatch.setattr(type(sched), "fill_masks", spy)
    params = _mixed_params()
    overlapped = [o.outputs[0].token_ids for o in llm.generate(["go"] * len(params), params)]
    assert len(deferred) > 10 and max(deferred) == 5
    monkeypatch.setattr(sched, "defer_masks", False)
    deferred.clear()
    landed_first = [o.outputs[0].token_ids for o in llm.generate(["go"] * len(params), params)]
    assert not deferred
    assert overlapped == landed_first


def test_grammar_that_fails_to_compile_fails_its_request_only(llm: LLM) -> None:
    bad, good = llm.generate(
        ["a", "b"],
        [
            SamplingParams(max_tokens=5, structured_outputs=_so(regex="((")),
            SamplingParams(max_tokens=5, structured_outputs=_so(choice=["ok"])),
        ],
    )
    assert bad.outputs[0].finish_reason == "error" and "regex" in (bad.error or "")
    assert good.outputs[0].text == "ok"


def test_abort_while_compiling(llm: LLM) -> None:
    from pdserve.core_types.messages import EngineCoreRequest
    from pdserve.engine.request import RequestStatus

    core = llm.engine
    sp = SamplingParams(max_tokens=5, structured_outputs=_so(regex="abort-me-[0-9]{40}"))
    core.add_request(EngineCoreRequest("r-abort", [5, 6], sp, [2], 5, 0.0))
    assert core.has_unfinished_requests()
    (out,) = core.abort_requests(["r-abort"], RequestStatus.FINISHED_ABORTED)
    assert out.finish_reason == "abort" and not core.has_unfinished_requests()


@pytest.mark.parametrize(
    "string",
    [{"type": "string"}, {"type": "string", "maxLength": 8}, {"type": "string", "minLength": 2}],
)
def test_json_strings_admit_no_control_character_or_surrogate(
    tiny_llama: Path, string: dict[str, Any]
) -> None:
    """Inside a JSON string the grammar refuses a raw control character (json.loads
    rejects it) and a UTF-8-encoded surrogate (invalid UTF-8), byte token by byte
    token, and takes an ordinary character of several bytes (xgrammar's own rules admit
    surrogates everywhere and control characters in length-bounded strings)."""
    import xgrammar as xgr

    from pdserve.engine.structured_output import StructuredOutputManager, tokenizer_info
    from pdserve.frontend.tokenizer import Tokenizer

    info = tokenizer_info(tiny_llama, 512)
    byte_token = {b[0]: i for i, b in reversed(list(enumerate(info.decoded_vocab))) if len(b) == 1}
    assert len(byte_token) == 256
    schema = {"type": "object", "properties": {"a": string}, "required": ["a"]}
    mgr = StructuredOutputManager(tiny_llama, 512)
    compiled = mgr.submit(_so(json=json.dumps(schema))).result()
    head = Tokenizer.from_pretrained(tiny_llama).encode('{"a": "x', add_special_tokens=False)

    def takes(raw: bytes) -> bool:
        m = xgr.GrammarMatcher(compiled)
        assert all(m.accept_token(t) for t in head)
        return all(m.accept_token(byte_token[b]) for b in raw)

    assert takes("é".encode()) and takes("你".encode())
    assert takes(b"\\n") == (len(string) == 1)  # a bounded string takes no escapes
    for bad in (b"\x03", b"\x1f", b"\n", b"\xed\xa0\x80", b"\xed\xbf\xbf"):
        assert not takes(bad), bad
    mgr.shutdown()
