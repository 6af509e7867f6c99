"""Streaming answers (``stream=true``): the one SSE renderer of completions and chat
completions.

:func:`stream_response` starts the engine requests (one per choice,
:class:`~pdserve.serving.api.choices.Choices`) and waits for choice 0's first output
before any byte is sent (so an engine rejection is still a plain HTTP 400), then
answers with an :class:`SSEResponse`. Its body (:func:`sse_events`) is one ``data:``
chunk per delta that carries tokens or a finish reason, the deltas of the choices
interleaved as they come, each chunk carrying its choice's index; then
(``include_usage``) a usage-only chunk (the prompt once, every choice's completion
tokens), then ``data: [DONE]``; an error after the status line becomes an in-stream
error event followed by ``[DONE]``. An endpoint only says how a delta of choice ``i``
becomes its choice (or choices: several chunks, or none while a parser holds text
back) and which chunk model carries it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.frontend.outputs import CompletionOutput, RequestOutput
from pdserve.serving.api.choices import Choices, choices_usage, open_choices
from pdserve.serving.api.errors import APIError
from pdserve.serving.api.generate import (
    CLIENT_CLOSED,
    ClientDisconnected,
    EngineJob,
    failed_request,
    now_s,
    run_until_disconnect,
)
from pdserve.serving.api.protocol import (
    ChatCompletionStreamResponse,
    CompletionStreamResponse,
    RequestError,
    StreamOptions,
    UsageInfo,
)
from pdserve.serving.api.state import ServingContext
from pdserve.serving.http import SSE_DONE, sse_error, sse_event

logger = logging.getLogger(__name__)

RenderDelta = Callable[[CompletionOutput, int, UsageInfo | None], list[str]]


async def stream_response(
    ctx: ServingContext,
    job: EngineJob,
    request: Request,
    *,
    chunk_type: type[CompletionStreamResponse] | type[ChatCompletionStreamResponse],
    response_id: str,
    model: str,
    options: StreamOptions | None,
    make_choice: Callable[[CompletionOutput, int], Any],
    first_extra: Callable[[RequestOutput], dict[str, Any]] | None = None,
) -> Response:
    """The streaming answer of either endpoint: ``chunk_type`` chunks, each with one
    choice ``make_choice`` makes of a delta of choice ``i`` (none in the usage chunk);
    499 when the client went away before the first output. ``make_choice`` may return
    a list of choices (one chunk each; an empty list sends nothing for that delta).
    ``first_extra``: fields of the stream's first chunk, from the first output."""
    opened = await open_choices(ctx, job, request)
    if opened is None:
        return Response(status_code=CLIENT_CLOSED)
    choices_, first = opened
    created = now_s()
    pending = first_extra(first) if first_extra is not None and first is not None else {}

    def render_chunk(choices: list[Any], usage: UsageInfo | None) -> str:
        nonlocal pending
        extra, pending = pending, {}
        chunk = chunk_type(
            id=response_id, created=created, model=model, choices=choices, usage=usage, **extra
        )
        return chunk.to_json()

    def render_delta(c: CompletionOutput, index: int, usage: UsageInfo | None) -> list[str]:
        made = make_choice(c, index)
        choices = made if isinstance(made, list) else [made]
        return [render_chunk([choice], usage) for choice in choices]

    def render_usage(usage: UsageInfo) -> str:
        return render_chunk([], usage)

    events = sse_events(
        ctx,
        choices_,
        first,
        render_delta=render_delta,
        render_usage=render_usage if options and options.include_usage else None,
        continuous_usage=bool(options and options.continuous_usage_stats),
    )
    return SSEResponse(events, on_close=choices_.close)


async def sse_events(
    ctx: ServingContext,
    choices: Choices,
    first: RequestOutput | None,
    *,
    render_delta: RenderDelta,
    render_usage: Callable[[UsageInfo], str] | None,
    continuous_usage: bool,
) -> AsyncIterator[str]:
    """The SSE body: one ``data:`` event per delta that carries tokens or a finish
    reason, then (``include_usage``) a usage-only event, then ``data: [DONE]``. Errors
    after the status line become an in-stream error event followed by ``[DONE]``."""
    job = choices.job
    completion_tokens = 0
    cached = 0
    events = choices.events(first)
    try:
        async for index, out in events:
            if index == 0:
                cached = max(cached, out.num_cached_tokens)
            for c in out.outputs[:1]:
                if c.finish_reason == "error":
                    raise failed_request(out.error)
                if not c.token_ids and not c.text and c.finish_reason is None:
                    continue
                completion_tokens += len(c.token_ids)
                usage = None
                if continuous_usage:
                    usage = choices_usage(ctx, job, completion_tokens, cached)
                for chunk in render_delta(c, index, usage):
                    yield sse_event(chunk)
    except Exception as e:
        if not isinstance(e, ValueError | APIError):
            logger.error("engine error while streaming %s: %r", job.request_id, e)
        yield error_event(e)
        yield SSE_DONE
        return
    finally:
        await events.aclose()
    if render_usage is not None:
        yield sse_event(render_usage(choices_usage(ctx, job, completion_tokens, cached)))
    yield SSE_DONE


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response that aborts its engine request when the client
    disconnects, and runs ``on_close`` exactly once however the stream ends."""

    def __init__(
        self,
        events: AsyncIterator[str],
        *,
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._events = events
        self._on_close = on_close

    @property
    def events(self) -> AsyncIterator[str]:
        """The events it would send (read by a batch that merges several streams)."""
        return self._events

    def close_events(self) -> None:
        """Run ``on_close`` for a stream that is never served itself."""
        self._on_close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await run_until_disconnect(receive, self.stream_response(send))
        except (ClientDisconnected, OSError):
            pass
        finally:
            aclose = getattr(self._events, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()


def error_event(exc: BaseException) -> str:
    """The in-stream error event for ``exc`` (the status line has already been sent)."""
    if isinstance(exc, RequestError):
        return sse_error(400, exc.message, exc.param)
    if isinstance(exc, ValueError):
        return sse_error(400, str(exc))
    if isinstance(exc, APIError):
        return sse_error(exc.status, exc.message, exc.param)
    return sse_error(500, f"the engine failed this request: {exc!r}")
