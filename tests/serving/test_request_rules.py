"""Validate once: every rule of a request (:mod:`pdserve.frontend.processor`) refuses the
same request at every entry point: the offline ``LLM.generate``, ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/responses`` (where the endpoint can express the
request), each hit once per rule. The API side runs over the fake engine (whose
``processor`` is the real one); the offline side over the tiny llama checkpoint, whose
engine must keep serving afterwards. The P/D proxy's own pre-checks are
``tests/proxy/test_proxy_misc.py::test_bad_requests_are_400``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.sampling_params import StructuredOutputsParams
from pdserve.frontend.processor import InputProcessor, InvalidRequest

from .conftest import FakeEngineClient, FakeTokenizer, ServerFactory, signed

BIG = 10**6  # outside every vocabulary here
MSG = [{"role": "user", "content": "hi"}]


@dataclass
class Rule:
    """One rule and the request that breaks it, per entry point (``None``: the entry
    cannot express it). ``api`` is the completions body (and the chat body unless
    ``chat`` is given); the functions take ``max_model_len``."""

    name: str
    text: str  # in the error message
    param: str | None  # the 400's param on /v1/completions
    api: Callable[[int], dict[str, Any]] | None
    offline: Callable[[int], tuple[Any, dict[str, Any]]] | None  # (prompt, params kwargs)
    chat: Callable[[int], dict[str, Any]] | None = None
    chat_param: str | None = "same"
    responses: Callable[[int], dict[str, Any]] | None = None
    responses_param: str | None = "same"


def _same(**kw: Any) -> tuple[Callable[[int], dict[str, Any]], Callable[[int], tuple]]:
    """A sampling rule: the same fields on the API and offline."""
    return (lambda _: dict(kw)), (lambda _: ("hi", dict(kw)))


def _rule(
    name: str, text: str, param: str | None, responses: dict | None = None, **kw: Any
) -> Rule:
    api, offline = _same(**kw)
    return Rule(
        name,
        text,
        param,
        api,
        offline,
        responses=(lambda _: dict(responses)) if responses is not None else None,
    )


RULES = [
    Rule(
        "prompt empty",
        "empty",
        "prompt",
        lambda _: {"prompt": ""},
        lambda _: ("", {}),
        chat=None,
    ),
    Rule(
        "prompt leaves no room",
        "maximum context length",
        "prompt",
        lambda n: {"prompt": [5] * n},
        lambda n: ({"prompt_token_ids": [5] * n}, {}),
        chat=lambda n: {"messages": [{"role": "user", "content": "x" * (n + 10)}]},
        chat_param="messages",
        responses=lambda n: {"input": "x" * (n + 10)},
        responses_param="input",
    ),
    Rule(
        "prompt ids in the vocabulary",
        "outside the vocabulary",
        "prompt",
        lambda _: {"prompt": [5, BIG]},
        lambda _: ({"prompt_token_ids": [5, BIG]}, {}),
    ),
    _rule("n", "[1, 64]", "n", n=65),
    _rule(
        "temperature",
        "temperature must be >= 0",
        "temperature",
        {"temperature": -1},
        temperature=-1.0,
    ),
    _rule("top_p", "top_p must be in (0, 1]", "top_p", {"top_p": 0}, top_p=0.0),
    _rule("top_k", "top_k must be", "top_k", top_k=-2),
    _rule("min_p", "min_p must be in [0, 1]", "min_p", min_p=1.5),
    Rule(
        "max_tokens",
        "max_tokens must be at least 1",
        "max_tokens",
        lambda _: {"max_tokens": -1},
        lambda _: ("hi", {"max_tokens": 0}),
        chat=lambda _: {"max_tokens": 0},
        responses=lambda _: {"max_output_tokens": 0},
        responses_param="max_output_tokens",
    ),
    _rule("min_tokens", "min_tokens must be >= 0", "min_tokens", min_tokens=-1),
    _rule(
        "min_tokens <= max_tokens",
        "min_tokens (5) must be <= max_tokens (2)",
        None,
        min_tokens=5,
        max_tokens=2,
    ),
    Rule(
        "logprobs",
        "logprobs must be in [0, 20]",
        "logprobs",
        lambda _: {"logprobs": 21},
        lambda _: ("hi", {"logprobs": 21}),
        chat=lambda _: {"logprobs": True, "top_logprobs": 21},
        chat_param="top_logprobs",
    ),
    _rule(
        "prompt_logprobs",
        "prompt_logprobs must be in [0, 20]",
        "prompt_logprobs",
        prompt_logprobs=21,
    ),
    Rule(
        "logit_bias values",
        "[-100, 100]",
        "logit_bias",
        lambda _: {"logit_bias": {"5": 200}},
        lambda _: ("hi", {"logit_bias": {5: 200.0}}),
    ),
    _rule(
        "presence_penalty",
        "presence_penalty must be in [-2, 2]",
        "presence_penalty",
        presence_penalty=3.0,
    ),
    _rule(
        "frequency_penalty",
        "frequency_penalty must be in [-2, 2]",
        "frequency_penalty",
        frequency_penalty=-3.0,
    ),
    _rule(
        "repetition_penalty",
        "repetition_penalty must be in (0, 2]",
        "repetition_penalty",
        repetition_penalty=0.0,
    ),
    _rule(
        "allowed_token_ids",
        "allowed_token_ids must not be empty",
        "allowed_token_ids",
        allowed_token_ids=[],
    ),
    Rule(
        "structured spec",
        "choice must be a list of non-empty strings",
        "structured_outputs",
        lambda _: {"structured_outputs": {"choice": []}},
        lambda _: ("hi", {"structured_outputs": StructuredOutputsParams(choice=[])}),
    ),
    Rule(
        "min_tokens with structured output",
        "min_tokens cannot be combined with structured output",
        None,
        lambda _: {"structured_outputs": {"choice": ["a"]}, "min_tokens": 1},
        lambda _: (
            "hi",
            {"structured_outputs": StructuredOutputsParams(choice=["a"]), "min_tokens": 1},
        ),
    ),
    _rule("bad_words", "bad_words must be non-empty", "bad_words", bad_words=[" "]),
    _rule("stop", "stop strings must be non-empty", "stop", stop=[""]),
    _rule("stop_token_ids", "stop_token_ids [1000000] are outside", None, stop_token_ids=[BIG]),
    Rule(
        "logit_bias ids",
        "logit_bias token ids",
        None,
        lambda _: {"logit_bias": {str(BIG): 1.0}},
        lambda _: ("hi", {"logit_bias": {BIG: 1.0}}),
    ),
    _rule("allowed_token_ids ids", "allowed_token_ids token ids", None, allowed_token_ids=[BIG]),
    Rule(
        "prompt + max_tokens",
        "maximum context length",
        "max_tokens",
        lambda n: {"max_tokens": n},
        lambda n: ("hi", {"max_tokens": n}),
        responses=lambda n: {"max_output_tokens": n},
        responses_param="max_output_tokens",
    ),
    _rule("priority", "--scheduling-policy priority", "priority", priority=1),
]


def _problem(r: httpx.Response, rule: Rule, param: str | None) -> str | None:
    """What is wrong with ``r`` as the refusal of ``rule`` (None: nothing)."""
    if r.status_code != 400:
        return f"{rule.name}: HTTP {r.status_code} {r.text[:200]}"
    err = r.json()["error"]
    if rule.text.lower() not in err["message"].lower():
        return f"{rule.name}: message {err['message']!r} lacks {rule.text!r}"
    if err["param"] != param:
        return f"{rule.name}: param {err['param']!r}, expected {param!r}"
    return None


def _refusals(
    url: str, path: str, base: dict[str, Any], cases: list[tuple[Rule, dict, str | None]]
) -> list[str]:
    problems = []
    with httpx.Client(base_url=url, timeout=10) as c:
        for rule, body, param in cases:
            problem = _problem(c.post(path, json={**base, **body}), rule, param)
            if problem:
                problems.append(problem)
    return problems


@pytest.fixture
def limited(make_server: ServerFactory) -> tuple[str, int]:
    engine = FakeEngineClient(max_model_len=64)
    return make_server(engine).url, engine.max_model_len


def test_completions_refuse_every_rule(limited: tuple[str, int]) -> None:
    url, n = limited
    cases = [(r, r.api(n), r.param) for r in RULES if r.api is not None]
    assert len(cases) == len(RULES)
    assert _refusals(url, "/v1/completions", {"prompt": "hi"}, cases) == []


def test_chat_completions_refuse_every_rule(limited: tuple[str, int]) -> None:
    url, n = limited
    cases = []
    for r in RULES:
        make = r.chat if r.chat is not None else (r.api if "prompt" not in r.api(n) else None)
        if make is not None:
            cases.append((r, make(n), r.param if r.chat_param == "same" else r.chat_param))
    assert len(cases) == len(RULES) - 2  # a chat cannot be empty, nor hold raw ids
    assert _refusals(url, "/v1/chat/completions", {"messages": MSG}, cases) == []


def test_responses_refuse_every_rule_it_can_express(limited: tuple[str, int]) -> None:
    url, n = limited
    cases = [
        (r, r.responses(n), r.param if r.responses_param == "same" else r.responses_param)
        for r in RULES
        if r.responses is not None
    ]
    assert len(cases) == 5  # input, temperature, top_p, max_output_tokens (twice)
    assert _refusals(url, "/v1/responses", {"input": "hi"}, cases) == []


def test_pd_rules_on_the_api(make_server: ServerFactory) -> None:
    """n > 1 on a prefill leg, prompt logprobs on a decode leg: refused with signed
    (otherwise valid) kv_transfer_params."""
    url = make_server(FakeEngineClient()).url
    ids = [5, 6, 7]
    decode_kv = {
        "do_remote_prefill": True,
        "remote_block_ids": [1],
        "remote_request_id": "p-1",
        "remote_host": "127.0.0.1",
        "remote_port": 7777,
    }
    with httpx.Client(base_url=url, timeout=10) as c:
        body = {
            "prompt": ids,
            "n": 2,
            "kv_transfer_params": signed({"do_remote_decode": True}, "pd-1"),
        }
        r = c.post("/v1/completions", json=body, headers={"X-Request-Id": "pd-1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        kv = signed(decode_kv, "pd-2", prompt_ids=ids)
        body = {"prompt": ids, "prompt_logprobs": 1, "kv_transfer_params": kv}
        r = c.post("/v1/completions", json=body, headers={"X-Request-Id": "pd-2"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        assert "do_remote_prefill" in r.json()["error"]["message"]


def test_processor_only_rules() -> None:
    """Rules no test engine here can reach: bad words under speculation, and the P/D
    limits (the offline LLM takes no kv_transfer_params)."""
    proc = InputProcessor(FakeTokenizer(), 64, 256, speculative=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="bad_words with speculative decoding") as e:
        proc.check([5], SamplingParams(bad_words=["x"]))
    assert e.value.param == "bad_words"
    prefill = KVTransferParams.parse({"do_remote_decode": True})
    with pytest.raises(InvalidRequest, match="do_remote_decode") as e:
        proc.check([5], SamplingParams(n=2), prefill)
    assert e.value.param == "n"
    proc.check([5], SamplingParams(n=1), prefill)  # one sample is fine


def test_offline_llm_refuses_every_rule(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    n = llm.engine.max_model_len
    problems = []
    for rule in RULES:
        assert rule.offline is not None
        prompt, kwargs = rule.offline(n)
        try:
            llm.generate(prompt, SamplingParams(**kwargs))
        except ValueError as e:
            if not re.search(re.escape(rule.text), str(e), re.IGNORECASE):
                problems.append(f"{rule.name}: {e}")
        else:
            problems.append(f"{rule.name}: accepted")
    assert problems == []
    out = llm.generate("still serving", SamplingParams(temperature=0, max_tokens=2))[0]
    assert len(out.outputs[0].token_ids) == 2
    llm.shutdown()
