"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

A request becomes the chat request that renders the same messages
(:meth:`~pdserve.serving.api.protocol_responses.ResponsesRequest.as_chat`), so the
template, length checks and sampling are the chat endpoint's. The answer is one
``response`` object whose ``output`` holds a ``reasoning`` item (only when the server
runs a ``--reasoning-parser`` and the model reasoned) and one assistant ``message``
item with one ``output_text`` part. ``status`` is ``completed``, or ``incomplete`` with
``incomplete_details.reason="max_output_tokens"`` when the length limit ended it, or
``cancelled`` when the server aborted it (shutdown). With tools, each tool call parsed
from the output (as on the chat endpoint) is a ``function_call`` item after them (the
message item is left out when there is no text besides the calls); a P/D prefill
leg's answer carries the engine's ``kv_transfer_params``.

Streaming sends typed SSE events (``event: <type>`` and ``data: {"type": <type>, …}``,
each with a ``sequence_number``): ``response.created``, ``response.in_progress``;
per item ``response.output_item.added``, ``response.content_part.added``, the text
deltas (``response.reasoning_text.delta`` / ``response.output_text.delta``), their
``….done``, ``response.content_part.done``, ``response.output_item.done``; then
each function call as ``response.output_item.added``,
``response.function_call_arguments.delta`` / ``….done`` and
``response.output_item.done`` once the output is complete; then
``response.completed`` (or ``response.incomplete``) with the whole response. No
``[DONE]`` line (the Responses API has none). An engine failure after the status line
is an ``error`` event.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pdserve.serving.api.chat import prepare_chat
from pdserve.serving.api.chat_output import ChatOutputParser
from pdserve.serving.api.generate import (
    CLIENT_CLOSED,
    EngineRequest,
    open_stream,
    run_to_completion,
)
from pdserve.serving.api.protocol import CHAT_FIELDS
from pdserve.serving.api.protocol_chat import ToolCall
from pdserve.serving.api.protocol_responses import ResponsesRequest
from pdserve.serving.api.state import ServingContext
from pdserve.serving.api.streaming import SSEResponse, error_event

logger = logging.getLogger(__name__)

# the Responses API's names of the fields the input processor's rules name
RESPONSES_FIELDS = {**CHAT_FIELDS, "prompt": "input", "max_tokens": "max_output_tokens"}


class _Answer:
    """The response object of one request, built as the output arrives."""

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, rid: str, model: str) -> None:
        self.ctx, self.req, self.rid, self.model = ctx, req, rid, model
        self.created_at = int(time.time())
        self.reasoning = ""
        self.content = ""
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.calls: list[ToolCall] = []  # the tool calls parsed from the output
        self.kv_transfer_params: dict[str, Any] | None = None  # a P/D prefill leg's

    def reasoning_item(self, status: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": f"rs_{self.rid}",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": self.reasoning}],
            "status": status,
        }

    def text_part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.content, "annotations": [], "logprobs": []}

    def message_item(self, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": f"msg_{self.rid}",
            "status": status,
            "role": "assistant",
            "content": [self.text_part()],
        }

    def call_item(self, i: int) -> dict[str, Any]:
        call = self.calls[i]
        return {
            "type": "function_call",
            "id": f"fc_{self.rid}_{i}",
            "call_id": call.id,
            "name": call.function.name,
            "arguments": call.function.arguments,
            "status": "completed",
        }

    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        if self.finish_reason == "abort":  # the server gave it up (shutdown)
            return "cancelled"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def body(self) -> dict[str, Any]:
        status = self.status()
        done = status != "in_progress"  # a final body: output items and usage
        output = []
        if done and self.reasoning:
            output.append(self.reasoning_item("completed"))
        if done and (self.content or not self.calls):
            output.append(self.message_item(status))
        if done:
            output += [self.call_item(i) for i in range(len(self.calls))]
        req = self.req
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        extra = {"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else {}
        return {
            "id": f"resp_{self.rid}",
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": bool(tools) and req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if tools else "none"),
            "tools": tools,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "user": req.user,
            "usage": {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.output_tokens,
            }
            if done
            else None,
            **extra,
        }


def _split(parser: ChatOutputParser, text: str, last: bool) -> tuple[str, str]:
    reasoning, content = "", ""
    for d in parser.feed(text, last=last):
        reasoning += d.reasoning_content or ""
        content += d.content or ""
    return reasoning, content


async def create_response(ctx: ServingContext, req: ResponsesRequest, request: Request) -> Response:
    model = ctx.check_model(req.model)
    chat_req = req.as_chat()
    job = await prepare_chat(ctx, chat_req, request, RESPONSES_FIELDS)
    parser = ctx.parsing.for_request(chat_req, job.prompt)
    answer = _Answer(ctx, req, job.request_id, model)
    answer.prompt_tokens = len(job.prompt_token_ids)
    if req.stream:
        opened = await open_stream(ctx, job, request)
        if opened is None:
            return Response(status_code=CLIENT_CLOSED)
        er, first = opened
        return SSEResponse(_events(er, first, answer, parser), on_close=er.close)
    acc = await run_to_completion(ctx, job, request)
    if acc is None:
        return Response(status_code=CLIENT_CLOSED)
    answer.reasoning, answer.content = _split(parser, acc.text, True)
    answer.calls = parser.calls
    if acc.kv_transfer_params is not None:
        answer.kv_transfer_params = acc.kv_transfer_params.to_dict()
    answer.output_tokens = len(acc.token_ids)
    answer.cached_tokens = acc.num_cached_tokens
    answer.finish_reason = acc.finish_reason
    return Response(json.dumps(answer.body(), ensure_ascii=False), media_type="application/json")


class _Events:
    """Typed SSE events with increasing sequence numbers."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, type_: str, **fields: Any) -> str:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(
    er: EngineRequest, first: Any, answer: _Answer, parser: ChatOutputParser
) -> AsyncIterator[str]:
    ev = _Events()
    yield ev("response.created", response=answer.body())
    yield ev("response.in_progress", response=answer.body())
    open_kind: str | None = None  # "reasoning" or "message": the item being written
    index = -1

    def open_item(kind: str) -> list[str]:
        nonlocal open_kind, index
        out = close_item() if open_kind is not None else []
        open_kind, index = kind, index + 1
        if kind == "reasoning":
            item, part = (
                answer.reasoning_item("in_progress"),
                {"type": "reasoning_text", "text": ""},
            )
        else:
            item, part = answer.message_item("in_progress"), {**answer.text_part(), "text": ""}
        item["content"] = []
        out.append(ev("response.output_item.added", output_index=index, item=item))
        out.append(
            ev("response.content_part.added", item_id=item["id"], output_index=index,
               content_index=0, part=part)
        )  # fmt: skip
        return out

    def close_item() -> list[str]:
        nonlocal open_kind
        if open_kind == "reasoning":
            item, kind = answer.reasoning_item("completed"), "reasoning_text"
            part: dict[str, Any] = {"type": "reasoning_text", "text": answer.reasoning}
            done = ev(f"response.{kind}.done", item_id=item["id"], output_index=index,
                      content_index=0, text=answer.reasoning)  # fmt: skip
        else:
            item, part = answer.message_item("completed"), answer.text_part()
            done = ev("response.output_text.done", item_id=item["id"], output_index=index,
                      content_index=0, text=answer.content, logprobs=[])  # fmt: skip
        open_kind = None
        return [
            done,
            ev("response.content_part.done", item_id=item["id"], output_index=index,
               content_index=0, part=part),
            ev("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    out = first
    try:
        while out is not None:
            answer.cached_tokens = max(answer.cached_tokens, out.num_cached_tokens)
            for c in out.outputs[:1]:
                if c.finish_reason == "error":
                    raise RuntimeError(out.error or "error")
                answer.output_tokens += len(c.token_ids)
                reasoning, content = _split(parser, c.text, c.finish_reason is not None)
                if reasoning:
                    if open_kind != "reasoning":
                        for event in open_item("reasoning"):
                            yield event
                    answer.reasoning += reasoning
                    yield ev("response.reasoning_text.delta", item_id=f"rs_{answer.rid}",
                             output_index=index, content_index=0, delta=reasoning)  # fmt: skip
                if content:
                    if open_kind != "message":
                        for event in open_item("message"):
                            yield event
                    answer.content += content
                    yield ev("response.output_text.delta", item_id=f"msg_{answer.rid}",
                             output_index=index, content_index=0, delta=content,
                             logprobs=[])  # fmt: skip
                if c.finish_reason is not None:
                    answer.finish_reason = c.finish_reason
            out = await er.next_output()
    except Exception as exc:
        logger.warning("responses stream %s failed: %r", answer.rid, exc)
        yield "event: error\n" + error_event(exc)
        return
    if answer.finish_reason is None:
        answer.finish_reason = "abort"
    answer.calls = parser.calls
    if open_kind != "message" and not answer.calls:  # an answer has a message or calls
        for event in open_item("message"):
            yield event
    if open_kind is not None:
        for event in close_item():
            yield event
    for i in range(len(answer.calls)):
        for event in _call_events(ev, answer, i, index + 1 + i):
            yield event
    final = "response.incomplete" if answer.status() == "incomplete" else "response.completed"
    yield ev(final, response=answer.body())


def _call_events(ev: _Events, answer: _Answer, i: int, index: int) -> list[str]:
    """One whole function call as stream events: the item, its arguments, the item done."""
    item = answer.call_item(i)
    args = item["arguments"]
    return [
        ev("response.output_item.added", output_index=index, item={**item, "arguments": "",
           "status": "in_progress"}),
        ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
           delta=args),
        ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
           arguments=args),
        ev("response.output_item.done", output_index=index, item=item),
    ]  # fmt: skip
