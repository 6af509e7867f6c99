"""``POST /v1/completions`` with a list of prompts (the OpenAI API's and vLLM's batch).

Each prompt is a request of its own (id ``<request id>-<i>``), answered by the one-prompt
path (:mod:`pdserve.serving.api.completions`); every prompt is validated and tokenized
before any of them starts, so a bad one is a 400 for the whole request. They run
concurrently. The answer is one response, ``cmpl-<request id>``, whose choices are every
prompt's in order: prompt ``i``'s choice ``j`` has index ``i * n + j``, as vLLM numbers
them. Usage sums the prompts' (each prompt counted once, as for ``n`` > 1).

Streaming: the prompts' chunks are interleaved as they come, each with its choice's
batch index and the response's id; one ``[DONE]`` ends the stream, after the summed
usage when ``stream_options.include_usage`` asked for it (``continuous_usage_stats``
is refused with a list of prompts: the running usage is per prompt). A client
disconnect aborts every prompt's requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import State
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive

from pdserve.serving.api.completions import answer_completion, prepare_completion
from pdserve.serving.api.protocol import CompletionRequest, StreamOptions
from pdserve.serving.api.protocol_base import RequestError
from pdserve.serving.api.state import ServingContext
from pdserve.serving.api.streaming import SSEResponse
from pdserve.serving.http import SSE_DONE, sse_event

_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


class _SharedReceive:
    """One reader of the ASGI ``receive`` for several waiters: after the body was read it
    only reports the disconnect, which every prompt's request must see."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Future[Message] | None = None

    async def __call__(self) -> Message:
        if self._task is None:
            self._task = asyncio.ensure_future(self._disconnect())
        return await asyncio.shield(self._task)

    async def _disconnect(self) -> Message:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return message

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class _Part:
    """The HTTP request as one prompt sees it: its own request id, the shared receive."""

    def __init__(self, request: Request, request_id: str, receive: _SharedReceive) -> None:
        self._request = request
        self.state = State({**request.state._state, "request_id": request_id})
        self.receive = receive

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


async def create_batched_completion(
    ctx: ServingContext, req: CompletionRequest, request: Request
) -> Response:
    model = ctx.check_model(req.model)
    options = req.stream_options
    if req.stream and options is not None and options.continuous_usage_stats:
        raise RequestError(
            "stream_options.continuous_usage_stats is not supported with a list of prompts "
            "(the running usage is per prompt)",
            "stream_options",
        )
    rid = request.state.request_id
    shared = _SharedReceive(request.receive)
    # each prompt's stream reports its usage, which the batch sums
    sub_options = StreamOptions(include_usage=True) if req.stream else None
    subs = [
        req.model_copy(update={"prompt": p, "stream_options": sub_options}) for p in req.prompts()
    ]
    parts = [_Part(request, f"{rid}-{i}", shared) for i in range(len(subs))]
    try:
        jobs = [
            await prepare_completion(ctx, s, p)  # type: ignore[arg-type]
            for s, p in zip(subs, parts, strict=True)
        ]
        answers = await asyncio.gather(
            *(
                answer_completion(ctx, s, p, job, model)  # type: ignore[arg-type]
                for s, p, job in zip(subs, parts, jobs, strict=True)
            ),
            return_exceptions=True,
        )
    finally:
        shared.close()
    n = req.n or 1
    failed = next((a for a in answers if not isinstance(a, Response)), None)
    refused = next((a for a in answers if isinstance(a, Response) and a.status_code != 200), None)
    if failed is not None or refused is not None:
        for a in answers:  # opened streams are closed (their requests aborted)
            if isinstance(a, SSEResponse):
                a.close_events()
        if failed is not None:
            raise failed
        return refused  # type: ignore[return-value]
    if not req.stream:
        return _merged_whole(answers, f"cmpl-{rid}", n)  # type: ignore[arg-type]
    streams: list[SSEResponse] = answers  # type: ignore[assignment]
    usage = options is not None and options.include_usage

    def close() -> None:
        for s in streams:
            s.close_events()

    return SSEResponse(_merged_events(streams, f"cmpl-{rid}", model, n, usage), on_close=close)


def _sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: sum(u.get(k) or 0 for u in usages) for k in _USAGE_KEYS}
    details = [u.get("prompt_tokens_details") for u in usages]
    if any(details):
        out["prompt_tokens_details"] = {
            "cached_tokens": sum((d or {}).get("cached_tokens") or 0 for d in details)
        }
    return out


def _merged_whole(answers: list[Response], response_id: str, n: int) -> Response:
    bodies = [json.loads(bytes(a.body)) for a in answers]
    out = bodies[0]
    out["id"] = response_id
    out["choices"] = [
        {**c, "index": i * n + c["index"]} for i, b in enumerate(bodies) for c in b["choices"]
    ]
    out["usage"] = _sum_usage([b["usage"] for b in bodies])
    return Response(json.dumps(out, ensure_ascii=False), media_type="application/json")


async def _merged_events(
    streams: list[SSEResponse], response_id: str, model: str, n: int, usage: bool
) -> AsyncIterator[str]:
    """Every prompt's chunks as they come, re-indexed (see the module doc)."""
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(i: int, events: AsyncIterator[str]) -> None:
        try:
            async for event in events:
                queue.put_nowait((i, event))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s.events)) for i, s in enumerate(streams)]
    usages: list[dict[str, Any]] = []
    created: int | None = None
    try:
        live = len(tasks)
        while live:
            i, event = await queue.get()
            if event is None:
                live -= 1
                continue
            if event == SSE_DONE:
                continue
            chunk = json.loads(event.removeprefix("data: "))
            if "error" in chunk:  # that prompt failed: the stream ends with its error
                yield event
                break
            created = chunk.get("created", created)
            if not chunk.get("choices"):  # its usage chunk
                usages.append(chunk.get("usage") or {})
                continue
            chunk["id"] = response_id
            chunk["choices"] = [{**c, "index": i * n + c["index"]} for c in chunk["choices"]]
            chunk["usage"] = None
            yield sse_event(json.dumps(chunk, ensure_ascii=False))
        else:
            if usage:
                last: dict[str, Any] = {"id": response_id, "object": "text_completion", "created": created,
                        "model": model, "choices": [], "usage": _sum_usage(usages)}  # fmt: skip
                yield sse_event(json.dumps(last))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    yield SSE_DONE
