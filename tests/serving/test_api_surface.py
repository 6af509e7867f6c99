"""The rest of the OpenAI/vLLM surface: ``/v1/models/{id}``, ``/v1/responses``, vLLM
request extras, the access log, ``vllm:`` metric aliases and the proxy's ``/version``."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

import pdserve
from pdserve.serving.api.app import build_app
from pdserve.serving.proxy.app import build_proxy_app

from .conftest import (
    MODEL,
    FakeEngineClient,
    FakeTokenizer,
    ServerFactory,
    ServerThread,
    pd_secret,
)


def client_for(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=10)


def test_model_by_id(make_server: ServerFactory) -> None:
    srv = make_server(FakeEngineClient(), served_model_names=[MODEL, "org/other"])
    client = client_for(srv)
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")
    assert client.models.retrieve("org/other").id == "org/other"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["message"] == "The model `nope` does not exist."  # type: ignore[index]


def test_responses_text_and_messages(make_server: ServerFactory) -> None:
    srv = make_server(FakeEngineClient())
    client = client_for(srv)
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    assert r.output_text == "abcd"
    assert r.status == "incomplete"  # stopped by max_output_tokens
    assert r.incomplete_details is not None
    assert r.usage is not None and r.usage.output_tokens == 4
    r = client.responses.create(
        model=MODEL,
        instructions="be brief",
        input=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "again"}]},
        ],
        max_output_tokens=3,
    )
    assert r.output_text == "abc" and r.id.startswith("resp_")
    engine = srv.app.state.pdserve.engine
    prompt = engine.tokenizer.decode(list(engine.requests.values())[-1][0])
    assert prompt == "<|system|>be brief\n<|user|>hi\n<|assistant|>yo\n<|user|>again\n<|assistant|>"


def test_responses_streaming_with_reasoning(make_server: ServerFactory) -> None:
    engine = FakeEngineClient(script="<think>why</think>Because.")
    srv = make_server(engine, reasoning_parser="glm45")
    events = list(client_for(srv).responses.create(model=MODEL, input="why?", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert "response.reasoning_text.delta" in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == "Because."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "completed" and final.output_text == "Because."
    assert [item.type for item in final.output] == ["reasoning", "message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function", "name": "f"}]}, "tool_choice"),  # auto needs flags
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ],
)
def test_responses_refusals(server: ServerThread, extra: dict, param: str) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/responses", json={"input": "hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_truncate_prompt_tokens(make_server: ServerFactory) -> None:
    engine = FakeEngineClient()
    srv = make_server(engine)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        long = "x" * 300 + "tail"  # longer than max_model_len=128: kept by truncation
        r = c.post(
            "/v1/completions", json={"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 4}
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 4
        assert list(engine.requests.values())[-1][0] == [ord(ch) for ch in "tail"]
        r = c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "y" * 300}],
                "max_tokens": 2,
                "truncate_prompt_tokens": 14,
            },
        )
        assert r.status_code == 200, r.text
        assert engine.tokenizer.decode(list(engine.requests.values())[-1][0]) == "\n<|assistant|>"
        r = c.post("/v1/completions", json={"prompt": "a", "truncate_prompt_tokens": 500})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_accepted_vllm_extras(server: ServerThread) -> None:
    body: dict[str, Any] = {
        "prompt": "hi",
        "max_tokens": 2,
        "cache_salt": "tenant-a",
        "priority": 0,
        "spaces_between_special_tokens": False,
    }
    with httpx.Client(base_url=server.url, timeout=10) as c:
        assert c.post("/v1/completions", json=body).status_code == 200
        r = c.post("/v1/completions", json={**body, "priority": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("on", [True, False])
def test_access_log(on: bool) -> None:
    srv = ServerThread(
        build_app(FakeEngineClient(), served_model_names=[MODEL], pd_secret=pd_secret())
    )
    srv.server.access_log = on
    handler = _Records()
    logger = logging.getLogger("uvicorn.access")
    srv.start()
    logger.addHandler(handler)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert c.get("/v1/models").status_code == 200
    finally:
        logger.removeHandler(handler)
        srv.stop()
    logged = [line for line in handler.lines if "/v1/models" in line]
    assert bool(logged) is on, handler.lines


def test_vllm_metric_aliases(make_server: ServerFactory) -> None:
    plain = make_server(FakeEngineClient())
    aliased = make_server(FakeEngineClient(), metrics_vllm_aliases=True)
    for srv in (plain, aliased):
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert (
                c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
            )
    assert "vllm:" not in httpx.get(f"{plain.url}/metrics").text
    text = httpx.get(f"{aliased.url}/metrics").text
    for name in (
        'vllm:num_requests_running{engine="0",model_name="fake-model"}',
        'vllm:num_requests_waiting{engine="0",model_name="fake-model"}',
        'vllm:kv_cache_usage_perc{engine="0",model_name="fake-model"} 0.25',
        'vllm:gpu_cache_usage_perc{engine="0",model_name="fake-model"} 0.25',
        'vllm:prompt_tokens_total{engine="0",model_name="fake-model"} 3.0',
        'vllm:generation_tokens_total{engine="0",model_name="fake-model"} 2.0',
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:time_per_output_token_seconds_bucket{",
        "vllm:inter_token_latency_seconds_count{",
        "vllm:e2e_request_latency_seconds_count{",
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="fake-model"} 1.0',
        "vllm:spec_decode_num_draft_tokens_total{",
        "pdserve:num_requests_running{",
    ):
        assert name in text, name


def test_proxy_version() -> None:
    app = build_proxy_app(["127.0.0.1:1"], ["127.0.0.1:2"], secret=pd_secret(), api_key="k")
    r = TestClient(app).get("/version")  # no lifespan: the route needs no upstream
    assert r.status_code == 200
    assert r.json() == {"version": pdserve.__version__}


def test_tool_messages_render_without_tools(server: ServerThread) -> None:
    """Role ``tool`` and assistant ``tool_calls`` are accepted with no tools at all."""
    msgs = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
        assert r.status_code == 200, r.text
        bad = [
            {
                **msgs[1],
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}],
            }
        ]
        r = c.post("/v1/chat/completions", json={"messages": [msgs[0], *bad], "max_tokens": 1})
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_fake_tokenizer_is_latin1() -> None:  # the script knob maps wide chars to 255
    assert FakeTokenizer().encode("é", add_special_tokens=False) == [233]


def test_tokenize_chat_with_tools() -> None:
    engine = FakeEngineClient(
        FakeTokenizer("{{ tools[0].function.name }}|{{ messages[0].content }}")
    )
    app = build_app(engine, served_model_names=[MODEL], pd_secret=pd_secret())
    body = {
        "messages": [{"role": "user", "content": "q"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    r = TestClient(app).post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == [ord(ch) for ch in "f|q"]


def test_health_answers_json_as_its_schema_says(server: ServerThread) -> None:
    r = httpx.get(f"{server.url}/health", timeout=5)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"status": "ok"}
    schema = httpx.get(f"{server.url}/openapi.json", timeout=5).json()
    ok = schema["paths"]["/health"]["get"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["type"] == "object"
