"""Structured output on a live ``pdserve serve`` (tiny random Llama, CPU, loopback): the
grammar forces valid output whatever the random weights say. The server runs
``--scheduling-policy priority``, so requests may carry a ``priority`` too."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest

from .conftest import LiveServer, start_server

# bounded everywhere, so a random model reaches the end well within max_tokens
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        # a length-bounded free string: xgrammar's own rule for it admits raw control
        # characters, which json.loads rejects (pdserve's grammar excludes them)
        "note": {"type": "string", "minLength": 1, "maxLength": 8},
    },
    "required": ["name", "age", "ok", "note"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}},
    },
]
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = start_server(
        tiny_llama,
        tmp_path_factory.mktemp("so"),
        "--max-model-len",
        "1024",
        "--scheduling-policy",
        "priority",
    )
    yield srv
    srv.stop()


def _client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0, timeout=60)


def _check_person(obj: Any) -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    jsonschema_rs.validate(PERSON, obj)
    assert set(obj) <= set(PERSON["properties"])  # type: ignore[arg-type]
    assert re.fullmatch("[a-z]{1,6}", obj["name"]) and 0 <= obj["age"] <= 120


def test_100_json_schema_responses_parse_and_validate(server: LiveServer) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    async def one(i: int) -> tuple[str | None, str | None]:
        r = await client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": f"person {i}"}],  # type: ignore[list-item]
            response_format=fmt,  # type: ignore[arg-type]
            temperature=1.0,
            seed=i,
            max_tokens=200,
            extra_body={"priority": i % 3 - 1},  # taken under --scheduling-policy priority
        )
        return r.choices[0].message.content, r.choices[0].finish_reason

    async def all_of_them() -> list[tuple[str | None, str | None]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(100)))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    assert len(results) == 100
    for text, reason in results:
        assert reason == "stop", (text, reason)
        assert text is not None
        _check_person(json.loads(text))
    assert len({text for text, _ in results}) > 50  # sampled, not one answer repeated


def test_choice_regex_grammar_and_json_object(server: LiveServer) -> None:
    c = _client(server)
    choices = ["alpha", "beta gamma", 'quote "q"']
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"guided_choice": choices}, lambda t: t in choices),
        ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
        ({"guided_regex": r"[a-c]{3}-\d{2}"}, lambda t: re.fullmatch(r"[a-c]{3}-\d{2}", t)),
        ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
        ({"guided_grammar": 'root ::= "x" ("y" | "z")'}, lambda t: t in ("xy", "xz")),
        ({"structured_outputs": {"json": PERSON}}, lambda t: _check_person(json.loads(t)) or 1),
    ]

    def complete(extra: dict[str, Any], seed: int, max_tokens: int = 200) -> tuple[str, str]:
        r = c.completions.create(
            model=server.model, prompt="say", max_tokens=max_tokens, seed=seed, extra_body=extra
        )
        return r.choices[0].text, r.choices[0].finish_reason

    jobs = [(extra, seed) for extra, _ in cases for seed in range(2)]  # 14, in parallel
    with ThreadPoolExecutor(len(jobs) + 2) as pool:  # concurrent: they share engine steps
        outs = list(pool.map(lambda j: complete(*j), jobs))
        any_object = list(
            pool.map(
                lambda s: complete({"response_format": {"type": "json_object"}}, s, 40), [0, 1]
            )
        )
    for ((extra, _), (text, reason)), ok in zip(
        zip(jobs, outs, strict=True), [ok for _, ok in cases for _ in range(2)], strict=True
    ):
        assert reason == "stop" and ok(text), (extra, text)
    # any JSON object: unbounded, so a random model may run to max_tokens; what it wrote
    # is a JSON object, or the start of one
    for text, reason in any_object:
        assert isinstance(json.loads(text), dict) if reason == "stop" else text[:1] == "{"
    # chat, streamed: the deltas join to a valid choice
    stream = c.chat.completions.create(
        model=server.model,
        messages=MSGS,  # type: ignore[arg-type]
        stream=True,
        max_tokens=50,
        extra_body={"guided_choice": choices},
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) in choices


def test_tool_choice_required_and_named(server: LiveServer) -> None:
    c = _client(server)
    names = {"get_weather", "noop"}

    def required(seed: int) -> Any:
        return c.chat.completions.create(
            model=server.model,
            messages=MSGS,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            seed=seed,
            max_tokens=300,
        )

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(required, range(2)))
    for r in answers:
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
        for call in msg.tool_calls:
            assert call.function.name in names
            assert isinstance(json.loads(call.function.arguments), dict)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(
        model=server.model,
        messages=MSGS,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=named,  # type: ignore[arg-type]
        max_tokens=100,
    )
    (call,) = r.choices[0].message.tool_calls or []
    args = json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Oslo")  # type: ignore[union-attr]
    assert 1 <= args["days"] <= 7
    # streamed: the name first, then argument pieces that join to the arguments
    stream = c.chat.completions.create(
        model=server.model,
        messages=MSGS,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=named,  # type: ignore[arg-type]
        max_tokens=100,
        stream=True,
    )
    calls = [tc for ch in stream if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "get_weather" and calls[0].id  # type: ignore[union-attr]
    args = json.loads("".join(tc.function.arguments or "" for tc in calls))  # type: ignore[union-attr]
    assert set(args) == {"city", "days"}
    # required, streamed: complete calls at the end
    stream = c.chat.completions.create(
        model=server.model,
        messages=MSGS,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        stream=True,
    )
    chunks = [ch for ch in stream if ch.choices]
    calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert len({tc.index for tc in calls}) == 1 and calls[0].function.name in names  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_forced_call_cut_by_max_tokens_returns_its_text(server: LiveServer) -> None:
    r = _client(server).chat.completions.create(
        model=server.model,
        messages=MSGS,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_tokens=4,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content and choice.message.content.startswith("[")


def test_langchain_with_structured_output(server: LiveServer) -> None:
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(pattern="^[a-z]{1,8}$")
        age: int = Field(ge=0, le=120)
        mood: Literal["happy", "sad"]

    llm = lc.ChatOpenAI(
        model=server.model,
        base_url=server.url + "/v1",
        api_key="k",
        max_tokens=200,
        max_retries=0,
        timeout=60,
    )
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Person, method=method).invoke("describe someone")
        assert isinstance(out, Person), method


@pytest.mark.parametrize(
    ("path", "body", "param", "text"),
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format",
            'Unsupported type "x"',
        ),
        ("/v1/completions", {"guided_regex": "(("}, "guided_regex", "parenthesis"),
        ("/v1/completions", {"guided_grammar": "root ::= x"}, "guided_grammar", "not defined"),
        ("/v1/completions", {"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one"),
        ("/v1/completions", {"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
            "tool_choice",
            "one output constraint",
        ),
    ],
)
def test_bad_constraints_are_400(
    server: LiveServer, path: str, body: dict[str, Any], param: str, text: str
) -> None:
    full = {"model": server.model, "max_tokens": 5, **body}
    full.setdefault("messages" if "chat" in path else "prompt", MSGS if "chat" in path else "x")
    r = httpx.post(server.url + path, json=full, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err
