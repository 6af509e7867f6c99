"""Protocol models: request → SamplingParams, prompt forms, rejections."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pdserve.frontend.processor import InputProcessor
from pdserve.serving.api.chat_template import ChatTemplates, detect_content_format
from pdserve.serving.api.protocol import (
    CHAT_FIELDS,
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    DeltaMessage,
    RequestError,
)

from .conftest import FakeTokenizer


def sp(req: CompletionRequest | ChatCompletionRequest, prompt_len: int = 4, max_len: int = 100):
    return req.to_sampling_params(prompt_len=prompt_len, max_model_len=max_len, vocab_size=50)


def test_completion_defaults_and_mapping() -> None:
    p = sp(CompletionRequest(prompt="x"))
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.logprobs) == (16, 1.0, 1.0, 0, None)
    p = sp(CompletionRequest(prompt="x", max_tokens=None))
    assert p.max_tokens == 96
    p = sp(CompletionRequest(prompt="x", top_k=1000, stop="END", logprobs=0, temperature=0))
    assert p.top_k == 0 and p.stop == ["END"] and p.logprobs == 0 and p.greedy
    p = sp(CompletionRequest(prompt="x", top_k=-1, stop_token_ids=[3], seed=5))
    assert p.top_k == 0 and p.stop_token_ids == [3] and p.seed == 5


def test_prompt_forms() -> None:
    assert CompletionRequest(prompt="hi").single_prompt() == "hi"
    assert CompletionRequest(prompt=[1, 2]).single_prompt() == [1, 2]
    assert CompletionRequest(prompt=["hi"]).single_prompt() == "hi"
    assert CompletionRequest(prompt=[[3, 4]]).single_prompt() == [3, 4]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    with pytest.raises(ValidationError, match="empty"):
        CompletionRequest(prompt=["a", ""])
    with pytest.raises(ValidationError, match="empty"):
        CompletionRequest(prompt=[])


def _checked(req: CompletionRequest, prompt_len: int = 4, max_len: int = 100) -> None:
    """The request's params through the input processor's rules (vocabulary of 50)."""
    proc = InputProcessor(FakeTokenizer(), max_len, 50)  # type: ignore[arg-type]
    proc.check([1] * prompt_len, sp(req, prompt_len, max_len))


def test_context_length_checks() -> None:
    """The lengths are the input processor's rules; the protocol only maps the fields."""
    assert sp(CompletionRequest(prompt="x", max_tokens=10), prompt_len=95).max_tokens == 10
    with pytest.raises(RequestError, match="maximum context length") as e:
        _checked(CompletionRequest(prompt="x", max_tokens=10), prompt_len=95)
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError, match="no room") as e:
        _checked(CompletionRequest(prompt="x", max_tokens=None), prompt_len=100)
    assert e.value.param == "prompt"
    with pytest.raises(RequestError, match="stop_token_ids"):
        _checked(CompletionRequest(prompt="x", stop_token_ids=[50]))


def test_chat_max_tokens_precedence_and_logprobs() -> None:
    msgs = [{"role": "user", "content": "x"}]
    assert sp(ChatCompletionRequest(messages=msgs)).max_tokens == 96
    assert sp(ChatCompletionRequest(messages=msgs, max_tokens=5)).max_tokens == 5
    req = ChatCompletionRequest(messages=msgs, max_tokens=5, max_completion_tokens=7, logprobs=True)
    p = sp(req)
    assert p.max_tokens == 7 and p.logprobs == 0
    assert (
        ChatCompletionRequest(messages=msgs, top_logprobs=0, tool_choice="none").logprobs is False
    )
    assert ChatCompletionRequest(messages=msgs, response_format={"type": "text"})


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 65}, "n"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ],
)
def test_chat_value_rejections_are_the_processors(extra: dict, param: str) -> None:
    """Values are the input processor's rules, named in the chat API's terms."""
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **extra)
    proc = InputProcessor(FakeTokenizer(), 100, 50)  # type: ignore[arg-type]
    with pytest.raises(RequestError) as e:
        proc.check([1] * 4, sp(req), names=CHAT_FIELDS)
    assert e.value.param == param


@pytest.mark.parametrize(
    "extra",
    [
        {"top_logprobs": 1},
        {"tools": [{"type": "function"}]},
        {"response_format": {"type": "json_schema"}},
        {"stream_options": {"include_usage": True}},
        {"functions": []},
    ],
)
def test_chat_rejections(extra: dict) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **extra)


def test_stream_chunk_json_drops_none_delta_fields() -> None:
    chunk = ChatCompletionStreamResponse(
        id="c",
        created=1,
        model="m",
        choices=[ChatCompletionStreamChoice(delta=DeltaMessage(content="hi"))],
    )
    assert '"delta":{"content":"hi"}' in chunk.to_json()
    assert '"finish_reason":null' in chunk.to_json()


def test_content_format_detection_and_joining() -> None:
    assert detect_content_format("{% for p in message['content'] %}{% endfor %}") == "openai"
    assert detect_content_format("{% for p in m.content %}{% endfor %}") == "openai"
    assert detect_content_format("{{ message['content'] }}") == "string"
    req = ChatCompletionRequest(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    )
    assert ChatTemplates.conversation(req.messages, "string")[0]["content"] == "a\nb"
    assert ChatTemplates.conversation(req.messages, "openai")[0]["content"][1] == {
        "type": "text",
        "text": "b",
    }
    with pytest.raises(ValueError, match="neither a readable file"):
        ChatTemplates("/nonexistent/template.jinja", "auto")
    with pytest.raises(ValueError, match="content_format"):
        ChatTemplates(None, "xml")


_json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=8)
)
_values = st.recursive(
    _json_scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=6,
)
_fields = st.sampled_from(
    ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
     "stop_token_ids", "n", "logprobs", "min_tokens", "ignore_eos", "stream", "stream_options",
     "best_of", "echo", "repetition_penalty", "kv_transfer_params"]
)  # fmt: skip


@settings(max_examples=100, deadline=None, database=None)
@given(st.dictionaries(_fields, _values, max_size=6), st.integers(1, 200))
def test_any_json_is_a_clean_error_or_valid_params(body: dict, prompt_len: int) -> None:
    try:
        req = CompletionRequest.model_validate(body)
    except ValidationError:
        return
    params = req.to_sampling_params(prompt_len=prompt_len, max_model_len=128, vocab_size=50)
    proc = InputProcessor(FakeTokenizer(), 128, 50)  # type: ignore[arg-type]
    try:
        proc.check([1] * prompt_len, params)
    except RequestError as e:
        assert e.message
        return
    assert params.max_tokens is not None and prompt_len + params.max_tokens <= 128


def test_lone_surrogates_are_found_anywhere_and_named() -> None:
    from pdserve.serving.api.unicode_check import find_lone_surrogate

    assert find_lone_surrogate({"prompt": "ok", "ids": list(range(1000))}) is None
    assert find_lone_surrogate({"prompt": "smile \U0001f642"}) is None  # a proper pair
    assert find_lone_surrogate("\udc00") == (None, 0, "U+DC00")
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab\ud800"}]}]}
    assert find_lone_surrogate(body) == ("messages.0.content.0.text", 2, "U+D800")
    assert find_lone_surrogate({"metadata": {"k\udfff": 1}}) == ("metadata.k\\udfff", 1, "U+DFFF")
    deep: list = []
    for _ in range(5000):  # no recursion
        deep = [deep]
    assert find_lone_surrogate({"x": deep}) is None
    with pytest.raises(ValidationError, match="lone surrogate"):
        CompletionRequest.model_validate({"prompt": "x", "stop": ["\ud800"]})
