"""400 / 401 / 404 / 503 answers, all with OpenAI error bodies (never FastAPI's 422)."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import openai
import pytest

from _polling import wait_until

from .conftest import MODEL, FakeEngineClient, ServerFactory, ServerThread


def assert_error(
    r: httpx.Response, status: int, *, param: str | None = "?", text: str = ""
) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if param != "?":
        assert err["param"] == param, err
    assert text.lower() in err["message"].lower(), err
    return err


def post(srv: ServerThread, path: str, body: Any, **kw: Any) -> httpx.Response:
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        if isinstance(body, bytes | str):
            return c.post(path, content=body, headers={"content-type": "application/json"}, **kw)
        return c.post(path, json=body, **kw)


COMPLETION_400 = [
    ({"prompt": "x", "temperature": -1}, "temperature", ""),
    ({"prompt": "x", "n": 65}, "n", "[1, 64]"),
    ({"prompt": "x", "n": 0}, "n", "[1, 64]"),
    ({"prompt": "x", "best_of": 3}, "best_of", "best_of must equal n"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of", "equal n (2)"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", ""),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", ""),
    ({"prompt": "x", "logit_bias": {"1": 200.0}}, "logit_bias", "[-100, 100]"),
    ({"prompt": "x", "logit_bias": {"one": 2.0}}, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"4096": 2.0}}, None, "logit_bias token ids"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ({"prompt": "x", "allowed_token_ids": [5, 999]}, None, "allowed_token_ids token ids"),
    ({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens", ""),
    ({"prompt": "x", "suffix": "s"}, "suffix", "suffix"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", ""),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", ""),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", ""),
    ({"prompt": "x", "repetition_penalty": 2.5}, "repetition_penalty", ""),
    ({"prompt": ["a", "b"], "kv_transfer_params": {}}, "prompt", "list of prompts"),
    ({"prompt": [[1, 2], [3, 999]]}, "prompt", "outside the vocabulary"),
    (
        {"prompt": ["a", "b"], "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options",
        "list of prompts",
    ),  # fmt: skip
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [5, 999]}, "prompt", "outside the vocabulary"),
    ({"prompt": [5, -1]}, "prompt", "outside the vocabulary"),
    ({"prompt": "x" * 200}, "prompt", "maximum context length"),
    ({"prompt": "x", "max_tokens": 500}, "max_tokens", "maximum context length"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ""),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, None, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [4096]}, None, "stop_token_ids"),
    ({"prompt": "x", "stop": [""]}, "stop", "non-empty"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": "x", "unknown_field": 1}, "unknown_field", "unsupported field"),
    ({"prompt": "x", "seed": 2**70}, "seed", ""),
    ({"max_tokens": 3}, "prompt", "required"),
    ({"prompt": "x", "top_p": 0}, "top_p", ""),
    ({"prompt": "x", "logprobs": 50}, "logprobs", ""),
    ({"prompt": "x", "logprobs": 21}, "logprobs", ""),
]


@pytest.mark.parametrize(("body", "param", "text"), COMPLETION_400)
def test_completion_400(server: ServerThread, body: dict, param: str | None, text: str) -> None:
    assert_error(post(server, "/v1/completions", body), 400, param=param, text=text)


CHAT_400 = [
    ({"n": 65}, "n", "[1, 64]"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", ""),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", ""),
    ({"top_logprobs": 1}, "top_logprobs", "needs logprobs=true"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    (
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        "tool_choice",
        "--enable-auto-tool-choice",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
        "tools",
        "strict=true is enforced only with",
    ),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "only 'function'"),
    ({"priority": 1}, "priority", "--scheduling-policy priority"),
    ({"messages": []}, "messages", ""),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", ""),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages",
        "'image_url' is not supported",
    ),
    ({"max_completion_tokens": 1000}, "max_tokens", "maximum context length"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs", ""),
    ({"messages": [{"role": "user", "content": "x" * 300}]}, "messages", "maximum context length"),
]


@pytest.mark.parametrize(("extra", "param", "text"), CHAT_400)
def test_chat_400(server: ServerThread, extra: dict, param: str | None, text: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param, text=text)


def test_invalid_json_and_wrong_types_are_400(server: ServerThread) -> None:
    assert_error(post(server, "/v1/completions", b"{not json"), 400, text="JSON")
    assert_error(post(server, "/v1/completions", b"[1, 2]"), 400)
    assert_error(post(server, "/v1/completions", {"prompt": {"a": 1}}), 400)
    assert_error(post(server, "/v1/completions", b'{"prompt": "x", "temperature": NaN}'), 400)
    assert_error(post(server, "/detokenize", {"tokens": [100000]}), 400, param="tokens")


def test_engine_value_error_is_400_streaming_or_not(server: ServerThread) -> None:
    for stream in (False, True):
        r = post(server, "/v1/completions", {"prompt": "REJECT me", "stream": stream})
        assert_error(r, 400, text="fake engine rejects")


def test_chat_template_errors_are_400(engine: FakeEngineClient, make_server: ServerFactory) -> None:
    srv = make_server(engine, chat_template="{{ raise_error_undefined() }}")
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert_error(r, 400, param="messages", text="chat template")
    engine2 = FakeEngineClient()
    engine2.tokenizer.chat_template = None
    srv2 = make_server(engine2)
    r = post(srv2, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert_error(r, 400, text="no chat template")


def test_unknown_model_is_404(server: ServerThread) -> None:
    r = post(server, "/v1/completions", {"model": "gpt-nope", "prompt": "x"})
    err = assert_error(r, 404, param="model", text="does not exist")
    assert err["type"] == "NotFoundError"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0, timeout=10)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="gpt-nope", messages=[{"role": "user", "content": "x"}]
        )
    assert_error(post(server, "/tokenize", {"model": "gpt-nope", "prompt": "x"}), 404)
    with httpx.Client(base_url=server.url, timeout=10) as c:
        assert_error(c.get("/v1/nothing-here"), 404)


def test_api_key(engine: FakeEngineClient, make_server: ServerFactory) -> None:
    srv = make_server(engine, api_key="sekrit")
    body = {"prompt": "x", "max_tokens": 1}
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        assert_error(c.post("/v1/completions", json=body), 401)
        bad = {"Authorization": "Bearer wrong"}
        assert_error(c.post("/v1/completions", json=body, headers=bad), 401)
        assert_error(c.get("/v1/models"), 401)
        ok = {"Authorization": "Bearer sekrit"}
        assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
    good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekrit", max_retries=0, timeout=10)
    assert good.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text == "a"
    wrong = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="nope", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_unhealthy_engine_is_503_on_health(
    server: ServerThread, server_engine: FakeEngineClient
) -> None:
    server_engine.healthy = False
    try:
        with httpx.Client(base_url=server.url, timeout=10) as c:
            assert_error(c.get("/health"), 503, text="unhealthy")
    finally:
        server_engine.healthy = True


def test_bad_request_id_header_is_400(server: ServerThread) -> None:
    r = post(server, "/v1/completions", {"prompt": "x"}, headers={"X-Request-Id": "has space"})
    assert_error(r, 400, param="X-Request-Id")


def test_duplicate_in_flight_request_id_is_400(
    make_server: ServerFactory,
) -> None:
    engine = FakeEngineClient(token_delay=0.02)
    srv = make_server(engine)
    body = {"prompt": "x", "max_tokens": 30}
    results: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: results.append(
            post(srv, "/v1/completions", body, headers={"X-Request-Id": "dup"})
        )
    )
    t.start()
    assert wait_until(lambda: "dup" in engine.running)
    r = post(srv, "/v1/completions", body, headers={"X-Request-Id": "dup"})
    assert_error(r, 400, param="X-Request-Id", text="already used")
    t.join(10)
    assert results and results[0].status_code == 200


def test_engine_death_is_500_or_an_in_stream_error(make_server: ServerFactory) -> None:
    engine = FakeEngineClient()
    srv = make_server(engine)
    r = post(srv, "/v1/completions", {"prompt": "CRASH", "max_tokens": 5})
    assert_error(r, 500, text="not healthy")
    engine.healthy = True
    r = post(
        srv,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "CRASH"}], "stream": True},
    )
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == 500
    assert "".join(json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-2]) == "ab"
