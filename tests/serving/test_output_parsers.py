"""Reasoning and tool-call parsers on texts written from each format's description:
whole, split into two pieces at every position, one character at a time, malformed."""

from __future__ import annotations

import json

import pytest

from pdserve.frontend.parsers import ReasoningParser, make_tool_call_parser, thinking_disabled
from pdserve.frontend.parsers.reasoning import ReasoningSplit
from pdserve.frontend.parsers.tool_calls import ToolEvents

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "tags": {"type": "array"},
                    "zip": {"type": "string"},
                },
            },
        },
    }
]


def splits(text: str) -> list[list[str]]:
    """The text whole, in two pieces at every position, and one character at a time."""
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    return out


def run_reasoning(style: str, pieces: list[str], **kw: object) -> ReasoningSplit:
    p = ReasoningParser(style, **kw)  # type: ignore[arg-type]
    total = ReasoningSplit()
    for piece in pieces:
        s = p.feed(piece)
        total.reasoning += s.reasoning
        total.content += s.content
    s = p.finish()
    return ReasoningSplit(total.reasoning + s.reasoning, total.content + s.content)


REASONING_CASES = [
    # style, prompt, output, reasoning, content
    (
        "glm45",
        None,
        "<think>Let me see.</think>The answer is 4.",
        "Let me see.",
        "The answer is 4.",
    ),
    ("glm45", None, "\n<think>a<b</think>\n\nok", "a<b", "\n\nok"),
    ("glm45", None, "No thinking here <think> at all", "", "No thinking here <think> at all"),
    ("glm45", "<|assistant|><think>", "plan</think>done", "plan", "done"),
    ("glm45", "<|assistant|><think></think>", "just text</think>", "", "just text</think>"),
    ("glm45", None, "<think>never closed", "never closed", ""),
    ("deepseek_r1", None, "thinking...</think>answer", "thinking...", "answer"),
    ("deepseek_r1", None, "<think>thinking</think>answer", "thinking", "answer"),
    ("deepseek_r1", None, "all reasoning, cut off", "all reasoning, cut off", ""),
    ("deepseek_r1", None, "<thi", "<thi", ""),
]


@pytest.mark.parametrize(("style", "prompt", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split_at_every_position(
    style: str, prompt: str | None, text: str, reasoning: str, content: str
) -> None:
    for pieces in splits(text):
        got = run_reasoning(style, pieces, prompt=prompt)
        assert (got.reasoning, got.content) == (reasoning, content), pieces


def test_reasoning_off() -> None:
    assert thinking_disabled({"enable_thinking": False})
    assert thinking_disabled({"thinking": False})
    assert not thinking_disabled({"enable_thinking": True}) and not thinking_disabled(None)
    got = run_reasoning("deepseek_r1", ["a</think>b"], enabled=False)
    assert (got.reasoning, got.content) == ("", "a</think>b")


def test_reasoning_streams_before_the_end_tag() -> None:
    p = ReasoningParser("glm45")
    assert p.feed("<think>abc</th").reasoning == "abc"  # "</th" is held back
    assert p.in_reasoning
    s = p.feed("ink>xyz")
    assert (s.reasoning, s.content) == ("", "xyz")


def run_tools(parser: str, pieces: list[str], tools: list | None = WEATHER) -> ToolEvents:
    p = make_tool_call_parser(parser, tools)
    out = ToolEvents()
    for piece in pieces:
        out.extend(p.feed(piece))
    out.extend(p.finish())
    return out


GLM45 = (
    "I will check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
)
GLM47 = (
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
)
DS31 = (
    "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
HERMES = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        ("glm45", GLM45, "I will check.\n"),
        ("glm47", GLM47, ""),
        ("glm47", GLM45, "I will check.\n"),
        ("glm45", GLM47, ""),
        ("deepseek_v31", DS31, "Checking."),
        ("hermes", HERMES, ""),
    ],
)
def test_tool_call_at_every_split(parser: str, text: str, content: str) -> None:
    for pieces in splits(text):
        out = run_tools(parser, pieces)
        assert out.content == content, pieces
        assert [c.name for c in out.calls] == ["get_weather"], pieces
        assert json.loads(out.calls[0].arguments) == {"city": "Paris", "days": 3}
        assert out.calls[0].id.startswith("call_")


def test_glm_values_typed_by_schema() -> None:
    text = (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>42</arg_value>"
        "<arg_key>zip</arg_key><arg_value>01234</arg_value>"
        "<arg_key>days</arg_key><arg_value>7</arg_value>"
        "<arg_key>metric</arg_key><arg_value>true</arg_value>"
        '<arg_key>tags</arg_key><arg_value>["a", "b"]</arg_value>'
        "<arg_key>other</arg_key><arg_value>5</arg_value></tool_call>"
    )
    args = json.loads(run_tools("glm47", [text]).calls[0].arguments)
    assert args == {
        "city": "42",
        "zip": "01234",
        "days": 7,
        "metric": True,
        "tags": ["a", "b"],
        "other": "5",  # not in the schema: text
    }
    # a value that does not decode stays text
    bad = "<tool_call>get_weather<arg_key>days</arg_key><arg_value>many</arg_value></tool_call>"
    assert json.loads(run_tools("glm45", [bad]).calls[0].arguments) == {"days": "many"}


def test_several_calls_and_whitespace_between() -> None:
    one = "<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>"
    two = "<tool_call>g\n</tool_call>"
    out = run_tools("glm45", ["pre ", one, "\n\n", two, "\n"], tools=None)
    assert out.content == "pre "
    assert [(c.name, c.arguments) for c in out.calls] == [("f", '{"x": "1"}'), ("g", "{}")]
    ds = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>\n"
        '<｜tool▁call▁begin｜>g<｜tool▁sep｜>{"a": [1]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    out = run_tools("deepseek_v31", list(ds))
    assert out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("f", {}), ("g", {"a": [1]})]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("glm45", "<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>"),
        ("glm45", "<tool_call>\n</tool_call>"),
        ("glm45", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par"),  # unclosed
        ("hermes", "<tool_call>{not json}</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
        ("deepseek_v31", "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{bad<｜tool▁call▁end｜>"),
        ("deepseek_v31", "<｜tool▁call▁begin｜>f{}<｜tool▁call▁end｜>"),
    ],
)
def test_malformed_calls_are_content(parser: str, text: str) -> None:
    for pieces in splits(text):
        out = run_tools(parser, pieces)
        assert out.calls == []
        assert out.content == text, pieces


def test_text_like_a_marker_prefix_is_released() -> None:
    p = make_tool_call_parser("hermes", None)
    assert p.feed("a <tool").content == "a "
    assert p.feed("box> b").content == "<toolbox> b"
    assert p.finish().content == ""


def test_server_parser_settings() -> None:
    import argparse

    from pdserve.serving.api.chat_output import OutputParsing
    from pdserve.serving.api.cli import add_cli_args

    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        OutputParsing(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        OutputParsing(reasoning_parser="nope")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        OutputParsing(tool_call_parser="nope")
    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args(
        ["m", "--enable-auto-tool-choice", "--tool-call-parser", "glm47",
         "--reasoning-parser", "glm45", "--disable-uvicorn-access-log", "--metrics-vllm-aliases"]
    )  # fmt: skip
    assert (args.tool_call_parser, args.reasoning_parser) == ("glm47", "glm45")
    assert args.enable_auto_tool_choice and args.disable_uvicorn_access_log
    assert args.metrics_vllm_aliases


def test_forced_required_calls_that_do_not_parse_are_content() -> None:
    """tool_choice "required": a whole array of calls becomes calls; text that is not
    one (cut by max_tokens) reaches the client as content, whole and streamed."""
    from pdserve.serving.api.chat_output import ForcedToolCalls

    good = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    msg = ForcedToolCalls(None).whole(good)
    assert msg.content is None and [c.function.name for c in msg.tool_calls] == ["get_weather"]
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Oslo"}
    for cut in (good[:30], "[]x", '[{"nam": 1}]', "7"):
        msg = ForcedToolCalls(None).whole(cut)
        assert msg.tool_calls == [] and msg.content == cut
        p = ForcedToolCalls(None)
        streamed = p.feed(cut[:3]) + p.feed(cut[3:], last=True)
        assert "".join(d.content or "" for d in streamed) == cut and not p.calls
        assert p.finish_reason("length") == "length"
    # a named call cut short keeps its text as the call's arguments
    named = ForcedToolCalls("get_weather")
    assert named.whole('{"city": "Os').tool_calls[0].function.arguments == '{"city": "Os'


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--all2all-backend", "deepep_low_latency"], "own dispatchers"),
        (["--fingerprint-mode", "none"], "system_fingerprint"),
        (["--trust-remote-code"], "no code from model folders"),
    ],
)
def test_vllm_flags_refused_with_a_reason(
    argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from pdserve.serving.api.cli import add_cli_args

    p = argparse.ArgumentParser()
    add_cli_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["m", *argv])
    err = capsys.readouterr().err
    assert f"{argv[0]} is not supported by pdserve" in err and reason in err

