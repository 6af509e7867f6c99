"""Tools, tool calls and reasoning through the official ``openai`` client, against a
fake engine whose output text is scripted (``FakeEngineClient(script=...)``)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from .conftest import MODEL, FakeEngineClient, FakeTokenizer, ServerFactory, ServerThread

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
# renders tools, tool calls of assistant messages and tool results, so tests can read them
TOOL_TEMPLATE = (
    "{% if tools %}[tools:{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{call {{ c.function.name }} city={{ c.function.arguments.city }}}{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GLM_OUT = (
    "<think>The user wants weather.</think>Let me look.\n<tool_call>get_weather\n"
    "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
    "<arg_value>2</arg_value>\n</tool_call>"
)
PARSERS = {"reasoning_parser": "glm45", "tool_call_parser": "glm47"}


def client_for(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=10)


def tool_server(make_server: ServerFactory, script: str, **kw: Any) -> ServerThread:
    engine = FakeEngineClient(FakeTokenizer(TOOL_TEMPLATE), script=script, max_model_len=2048)
    kw.setdefault("enable_auto_tool_choice", True)
    return make_server(engine, **{**PARSERS, **kw})


def prompt_of(srv: ServerThread) -> str:
    engine = srv.app.state.pdserve.engine
    ids = list(engine.requests.values())[-1][0]
    return str(engine.tokenizer.decode(ids))


def test_tool_call_non_streaming(make_server: ServerFactory) -> None:
    srv = tool_server(make_server, GLM_OUT)
    messages: list[Any] = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "and Paris?"},
    ]
    r = client_for(srv).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content == "Let me look.\n"
    assert msg.model_extra is not None
    assert msg.model_extra["reasoning_content"] == "The user wants weather."
    assert msg.tool_calls is not None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}  # type: ignore[union-attr]
    prompt = prompt_of(srv)
    assert prompt.startswith("[tools:get_weather;]")
    assert "{call get_weather city=Rome}" in prompt and "(for call_1)" in prompt


def test_tool_call_streaming(make_server: ServerFactory) -> None:
    srv = tool_server(make_server, GLM_OUT)
    stream = client_for(srv).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, stream=True
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == "The user wants weather."
    assert content == "Let me look.\n"
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].index == 0 and calls[0].id and calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    args = "".join(tc.function.arguments or "" for tc in calls if tc.function)
    assert json.loads(args) == {"city": "Paris", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # reasoning deltas all come before content deltas
    kinds = [
        "r" if (d.model_extra or {}).get("reasoning_content") else "c"
        for d in deltas
        if d.content or (d.model_extra or {}).get("reasoning_content")
    ]
    assert kinds == sorted(kinds, reverse=True)

    # the SDK's own accumulator assembles the same message
    with client_for(srv).chat.completions.stream(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS
    ) as s:
        final = s.get_final_completion()
    fc = final.choices[0].message.tool_calls
    assert fc is not None and fc[0].function.name == "get_weather"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("parser", "script"),
    [
        (
            "deepseek_v31",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        ),
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
        (
            "glm45",
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
        ),
    ],
)
def test_each_format_end_to_end(make_server: ServerFactory, parser: str, script: str) -> None:
    srv = tool_server(make_server, script, tool_call_parser=parser, reasoning_parser=None)
    for stream in (False, True):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            r = c.post("/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            msg = r.json()["choices"][0]["message"]
            assert msg["content"] is None
            assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
        else:
            events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
            names = [
                tc["function"].get("name")
                for e in events
                for tc in e["choices"][0]["delta"].get("tool_calls", [])
            ]
            assert "get_weather" in names


def test_malformed_call_is_content_and_tool_choice_none(make_server: ServerFactory) -> None:
    bad = "<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>"
    srv = tool_server(make_server, bad, reasoning_parser=None)
    client = client_for(srv)
    msgs: list[Any] = [{"role": "user", "content": "x"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    good = tool_server(make_server, GLM_OUT, reasoning_parser=None)
    r = client_for(good).chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none"
    )
    assert r.choices[0].message.content == GLM_OUT  # not parsed
    assert prompt_of(good).startswith("[tools:get_weather;]")  # but the template saw them


def test_reasoning_on_off(make_server: ServerFactory) -> None:
    srv = tool_server(make_server, "<think>hmm</think>4", tool_call_parser=None,
                      enable_auto_tool_choice=False)  # fmt: skip
    client = client_for(srv)
    msgs: list[Any] = [{"role": "user", "content": "2+2"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs)
    assert r.choices[0].message.content == "4"
    assert (r.choices[0].message.model_extra or {})["reasoning_content"] == "hmm"
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert r.choices[0].message.content == "<think>hmm</think>4"
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, extra_body={"include_reasoning": False}
    )
    assert r.choices[0].message.content == "4"
    assert (r.choices[0].message.model_extra or {}).get("reasoning_content") is None


def test_auto_tool_choice_needs_the_flag(make_server: ServerFactory) -> None:
    srv = tool_server(make_server, "x", enable_auto_tool_choice=False)
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client_for(srv).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS
        )
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client_for(srv).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


def test_langchain_bind_tools(make_server: ServerFactory) -> None:
    lc = pytest.importorskip("langchain_openai")
    srv = tool_server(make_server, GLM_OUT)

    def get_weather(city: str, days: int = 1) -> str:
        """Weather in a city."""
        return "sunny"

    llm = lc.ChatOpenAI(model=MODEL, base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    msg = llm.bind_tools([get_weather]).invoke("weather in Paris?")
    assert msg.tool_calls[0]["name"] == "get_weather"
    assert msg.tool_calls[0]["args"] == {"city": "Paris", "days": 2}


def test_parallel_tool_calls_false_keeps_the_first(make_server: ServerFactory) -> None:
    one = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>A</arg_value></tool_call>"
    two = one.replace(">A<", ">B<")
    srv = tool_server(make_server, one + two, reasoning_parser=None)
    msgs: list[Any] = [{"role": "user", "content": "x"}]
    client = client_for(srv)
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
    assert len(r.choices[0].message.tool_calls or []) == 2
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, parallel_tool_calls=False, logprobs=True
    )
    calls = r.choices[0].message.tool_calls or []
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "A"}]  # type: ignore[union-attr]
    # streamed with logprobs: every token's logprob arrives although text is held back
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, stream=True, logprobs=True
    )
    n = sum(
        len(c.choices[0].logprobs.content or [])
        for c in stream
        if c.choices and c.choices[0].logprobs
    )
    assert n == len(one + two)


RESPONSES_TOOLS: list[Any] = [{"type": "function", **TOOLS[0]["function"]}]


def test_responses_with_tools(make_server: ServerFactory) -> None:
    """/v1/responses takes function tools in its own shape and earlier calls and their
    outputs as input items; parsed calls come back as function_call items, whole and
    streamed."""
    srv = tool_server(make_server, GLM_OUT)
    client = client_for(srv)
    history: list[Any] = [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "user", "content": "and Paris?"},
    ]  # fmt: skip
    r = client.responses.create(model=MODEL, input=history, tools=RESPONSES_TOOLS)
    assert prompt_of(srv) == (
        "[tools:get_weather;]<|user|>weather?\n<|assistant|>{call get_weather city=Rome}\n"
        "<|tool|>sunny(for call_1)\n<|user|>and Paris?\n<|assistant|>"
    )
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message", "function_call"]
    call = r.output[-1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}  # type: ignore[union-attr]
    assert r.output_text == "Let me look.\n" and r.tools[0].name == "get_weather"  # type: ignore[union-attr]
    events = list(client.responses.create(model=MODEL, input="w?", tools=RESPONSES_TOOLS, stream=True))
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(args) == 1 and json.loads(args[0].arguments)["city"] == "Paris"  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_forced_tool_choice(make_server: ServerFactory) -> None:
    """tool_choice required / named constrain the output (structured output) and need
    no parser flags; the answer has the calls and no empty message."""
    call = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    srv = make_server(FakeEngineClient(FakeTokenizer(TOOL_TEMPLATE), script=call))
    client = client_for(srv)
    r = client.responses.create(
        model=MODEL, input="w?", tools=RESPONSES_TOOLS, tool_choice="required"
    )
    assert [i.type for i in r.output] == ["function_call"]
    assert json.loads(r.output[0].arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
    engine = srv.app.state.pdserve.engine
    spec = list(engine.requests.values())[-1][1].structured_outputs
    assert spec is not None and "get_weather" in (spec.json or "")
    named = {"type": "function", "name": "get_weather"}
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        bad = c.post("/v1/responses", json={"input": "w", "tools": RESPONSES_TOOLS,
                                            "tool_choice": {"type": "file_search"}})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
        ok = c.post("/v1/responses", json={"input": "w", "tools": RESPONSES_TOOLS,
                                           "tool_choice": named})  # fmt: skip
        assert ok.status_code == 200, ok.text
        assert ok.json()["output"][0]["name"] == "get_weather"
