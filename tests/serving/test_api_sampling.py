"""Top logprobs, ``logit_bias`` and ``allowed_token_ids`` through the API server with the
official ``openai`` client (fake engine: token i is ``'a' + i``, its top-N alternatives
are the ids after it at -0.5, -1.5, ...)."""

from __future__ import annotations

import json

import httpx
import openai

from .conftest import MODEL, FakeEngineClient, ServerThread


def client_for(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=10)


MSGS = [{"role": "user", "content": "q"}]


def test_completion_top_logprobs(server: ServerThread, server_engine: FakeEngineClient) -> None:
    r = client_for(server).completions.create(model=MODEL, prompt="q", max_tokens=2, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == ["a", "b"] and lp.token_logprobs == [-0.5, -0.5]
    assert lp.top_logprobs == [
        {"a": -0.5, "b": -1.5, "c": -2.5},
        {"b": -0.5, "c": -1.5, "d": -2.5},
    ]
    params = next(p for _, p, _ in server_engine.requests.values() if p.logprobs == 3)
    assert params.logprobs == 3


def test_completion_top_logprobs_streaming(server: ServerThread) -> None:
    stream = client_for(server).completions.create(
        model=MODEL, prompt="q", max_tokens=3, logprobs=2, stream=True
    )
    tops = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.top_logprobs:
                tops.extend(choice.logprobs.top_logprobs)
    assert tops == [{"a": -0.5, "b": -1.5}, {"b": -0.5, "c": -1.5}, {"c": -0.5, "d": -1.5}]


def test_chat_top_logprobs(server: ServerThread) -> None:
    c = client_for(server)
    chat = c.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=2,
        logprobs=True,
        top_logprobs=2,  # type: ignore[arg-type]
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [(x.token, x.logprob) for x in content] == [("a", -0.5), ("b", -0.5)]
    tops = [[(t.token, t.logprob, t.bytes) for t in x.top_logprobs] for x in content]
    assert tops == [
        [("a", -0.5, [97]), ("b", -1.5, [98])],
        [("b", -0.5, [98]), ("c", -1.5, [99])],
    ]
    # streaming: every token's alternatives arrive with it
    stream = c.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=3,
        logprobs=True,
        top_logprobs=1,
        stream=True,  # type: ignore[arg-type]
    )
    got = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                got.extend([t.token for t in x.top_logprobs] for x in choice.logprobs.content)
    assert got == [["a"], ["b"], ["c"]]


def test_chat_logprobs_without_top_have_empty_alternatives(server: ServerThread) -> None:
    chat = client_for(server).chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=1,
        logprobs=True,  # type: ignore[arg-type]
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and content[0].top_logprobs == []


def test_logit_bias_and_allowed_token_ids_reach_the_engine(
    server: ServerThread, server_engine: FakeEngineClient
) -> None:
    c = client_for(server)
    c.completions.create(
        model=MODEL,
        prompt="q",
        max_tokens=1,
        logit_bias={"97": 5.5, "98": -100},
        extra_body={"allowed_token_ids": [97, 98, 99]},
        extra_headers={"X-Request-Id": "bias-1"},
    )
    _, params, _ = server_engine.requests["bias-1"]
    assert params.logit_bias == {97: 5.5, 98: -100.0}
    assert params.allowed_token_ids == [97, 98, 99]
    c.chat.completions.create(
        model=MODEL,
        messages=MSGS,  # type: ignore[arg-type]
        max_tokens=1,
        logit_bias={"100": 1},
        extra_body={"allowed_token_ids": [100]},
        extra_headers={"X-Request-Id": "bias-2"},
    )
    _, params, _ = server_engine.requests["bias-2"]
    assert params.logit_bias == {100: 1.0} and params.allowed_token_ids == [100]


def test_bad_logit_bias_is_a_400(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as h:
        r = h.post(
            "/v1/chat/completions",
            json={"messages": MSGS, "logit_bias": {"97": -101}},
        )
    assert r.status_code == 400
    err = json.loads(r.text)["error"]
    assert err["param"] == "logit_bias" and "[-100, 100]" in err["message"]


def test_penalties_reach_the_engine(server: ServerThread, server_engine: FakeEngineClient) -> None:
    client_for(server).chat.completions.create(
        model=MODEL,
        messages=MSGS,  # type: ignore[arg-type]
        max_tokens=1,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        extra_body={"repetition_penalty": 1.3},
        extra_headers={"X-Request-Id": "pen-1"},
    )
    _, params, _ = server_engine.requests["pen-1"]
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert params.repetition_penalty == 1.3 and params.has_penalties


def test_the_input_processor_with_speculation() -> None:
    """Penalties and structured output are served with speculative decoding; bad_words
    are refused with a reason."""
    import pytest

    from pdserve.core_types.sampling_params import SamplingParams, StructuredOutputsParams
    from pdserve.frontend.processor import InputProcessor

    from .conftest import FakeTokenizer

    proc = InputProcessor(FakeTokenizer(), 64, 256, speculative=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad_words with speculative decoding"):
        proc.make_request("r", [5, 6], SamplingParams(bad_words=["x"]))
    proc.make_request("r", [5, 6], SamplingParams(frequency_penalty=0.5))
    so = StructuredOutputsParams(choice=["a"])
    proc.make_request("r", [5, 6], SamplingParams(structured_outputs=so))
    proc.make_request("r", [5, 6], SamplingParams(logit_bias={5: 1.0}))
