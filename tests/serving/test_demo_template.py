"""The demo model's chat template (assets/demo-glm5) renders tools, earlier tool calls and
their results, and the thinking switch, in the GLM format its parser flags read
(``--tool-call-parser glm47 --reasoning-parser glm45``): a call written the way the
template shows calls is parsed into that call, so ``tool_choice: auto`` can yield one."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.frontend.parsers import ReasoningParser, make_tool_call_parser
from pdserve.frontend.tokenizer import Tokenizer
from pdserve.serving.api.chat_template import ChatTemplates
from pdserve.serving.api.protocol import ChatMessageParam
from pdserve.serving.api.protocol_chat import ToolCallFunctionParam, ToolCallParam

DEMO = Path(__file__).resolve().parents[2] / "assets" / "demo-glm5"
TOOLS = [
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


def _render(messages: list[ChatMessageParam], **kw: object) -> str:
    return ChatTemplates(None, "auto").render(
        Tokenizer.from_pretrained(DEMO),
        messages,
        add_generation_prompt=True,
        **kw,  # type: ignore[arg-type]
    )


def test_tools_calls_results_and_thinking() -> None:
    call = ToolCallParam(
        id="c1",
        function=ToolCallFunctionParam(
            name="get_weather", arguments='{"city": "Paris", "days": 2}'
        ),
    )
    messages = [
        ChatMessageParam(role="user", content="weather in Paris?"),
        ChatMessageParam(role="assistant", content="", tool_calls=[call]),
        ChatMessageParam(role="tool", tool_call_id="c1", content="sunny"),
        ChatMessageParam(role="user", content="and Oslo?"),
    ]
    text = _render(messages, template_kwargs=None, tools=TOOLS)
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools") and '"get_weather"' in text
    assert "<|observation|>\n<tool_response>sunny</tool_response><|user|>\nand Oslo?" in text
    assert text.endswith("<|assistant|>\n")
    shown = text[text.index("<|assistant|>\n<tool_call>") + 14 : text.index("<|observation|>")]
    parser = make_tool_call_parser("glm47", TOOLS)
    events = parser.feed(shown)
    events.extend(parser.finish())
    got = [(c.name, json.loads(c.arguments)) for c in events.calls]
    assert got == [("get_weather", {"city": "Paris", "days": 2})] and not events.content
    # thinking off: the template closes an empty think block, which the parser reads
    off = _render(messages[:1], template_kwargs={"enable_thinking": False}, tools=None)
    assert off.endswith("<|assistant|>\n<think></think>")
    quiet = ReasoningParser("glm45", prompt=off).feed("<think>no</think>It is sunny.")
    assert quiet.reasoning == "" and quiet.content == "<think>no</think>It is sunny."
    split = ReasoningParser("glm45", prompt=_render(messages[:1], template_kwargs=None))
    out = split.feed("<think>weather is asked</think>It is sunny.")
    assert (out.reasoning, out.content) == ("weather is asked", "It is sunny.")


def test_plain_chats_render_as_the_model_was_prompted() -> None:
    messages = [
        ChatMessageParam(role="system", content="be brief"),
        ChatMessageParam(role="user", content="def f("),
    ]
    text = _render(messages, template_kwargs=None)
    assert text == "[gMASK]<sop><|system|>\nbe brief<|user|>\ndef f(<|assistant|>\n"
