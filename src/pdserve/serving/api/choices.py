"""The engine requests of one HTTP request, one per choice, and the non-streaming
answer of completions and chat completions.

``n`` > 1 (:class:`Choices`): one :class:`~pdserve.serving.api.generate.EngineRequest`
per choice, made by :func:`pdserve.frontend.parallel.fan_out` (child ids, derived seeds,
``prompt_logprobs`` on choice 0 only). They start together, so the first admitted fills
the prefix cache with the prompt and the others hit it; on a P/D decode instance
(``do_remote_prefill``) only choice 0 carries the ``kv_transfer_params`` and the others
start once its first output arrived (the pulled KV is then in the prefix cache).
``Choices.close`` closes every child (aborting the unfinished), so a client disconnect
aborts them all. With n = 1 there is one child, the request itself, read directly (no
extra task or queue on the hot path).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pdserve.frontend.outputs import RequestOutput
from pdserve.serving.api.errors import APIError
from pdserve.serving.api.generate import (
    CLIENT_CLOSED,
    Accumulated,
    ClientDisconnected,
    EngineJob,
    EngineRequest,
    collect,
    engine_failure,
    failed_request,
    make_usage,
    run_until_disconnect,
    start_and_wait,
)
from pdserve.serving.api.protocol import (
    ChatCompletionResponse,
    CompletionResponse,
    UsageInfo,
)
from pdserve.serving.api.state import ServingContext


class Choices:
    """The engine requests of one HTTP request, one per choice (see the module doc).

    Lifecycle: :meth:`start` (choice 0, and the others unless they wait for its first
    output: :meth:`start_rest`), then :meth:`collect` or :meth:`events`, then
    :meth:`close`, always, exactly once effective."""

    def __init__(self, ctx: ServingContext, job: EngineJob) -> None:
        self.job = job
        self.requests = [EngineRequest(ctx, j) for j in job.children()]
        self._started = 0

    @property
    def n(self) -> int:
        return len(self.requests)

    def start(self) -> None:
        self.requests[0].start()
        self._started = 1
        if not self.job.delays_siblings:
            self.start_rest()

    def start_rest(self) -> None:
        while self._started < self.n:
            self.requests[self._started].start()
            self._started += 1

    def _start_after(self, first: RequestOutput | None) -> None:
        """Start the delayed choices once choice 0's first output came (not when it
        failed or ended without one: the answer is an error or an abort anyway)."""
        if first is not None and not first.error:
            self.start_rest()

    async def collect(self) -> list[Accumulated]:
        """Every choice's whole output, in index order."""
        head = Accumulated()
        if self._started < self.n:
            first = await self.requests[0].next_output()
            if first is not None:
                head.add(first)
            self._start_after(first)
        tails = [collect(er) for er in self.requests[1 : self._started]]
        accs = await asyncio.gather(collect(self.requests[0], head), *tails)
        for _ in range(self._started, self.n):  # never started: reported as aborted
            accs.append(Accumulated(finish_reason="abort"))
        return list(accs)

    async def events(
        self, first: RequestOutput | None
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(choice index, delta output) as they come, after choice 0's ``first``; ends
        once every choice ended. With n > 1 one task per choice reads its outputs; they
        are cancelled and awaited when the iteration ends, however it ends."""
        if first is not None:
            yield 0, first
        if self.n == 1:
            er = self.requests[0]
            while (out := await er.next_output()) is not None:
                yield 0, out
            return
        if self._started < self.n:
            self._start_after(first)
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        pumps = [
            asyncio.ensure_future(_pump(i, er, queue))
            for i, er in enumerate(self.requests[: self._started])
        ]
        try:
            live = len(pumps)
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def close(self) -> None:
        for er in self.requests:
            er.close()


async def _pump(
    index: int,
    er: EngineRequest,
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]],
) -> None:
    """Forward one choice's outputs into ``queue``, then ``None`` (or its exception)."""
    try:
        while (out := await er.next_output()) is not None:
            queue.put_nowait((index, out))
    except Exception as e:
        queue.put_nowait((index, e))
        return
    queue.put_nowait((index, None))


async def run_choices(
    ctx: ServingContext, job: EngineJob, request: Request
) -> list[Accumulated] | None:
    """:func:`run_to_completion` of every choice: their whole outputs in index order, or
    ``None`` when the client went away (every choice is aborted)."""
    choices = Choices(ctx, job)
    try:
        choices.start()
        accs = await run_until_disconnect(request.receive, choices.collect())
    except ClientDisconnected:
        return None
    except (ValueError, APIError):
        raise
    except Exception as e:
        raise await engine_failure(ctx, e) from e
    finally:
        choices.close()
    for acc in accs:
        if acc.finish_reason == "error":  # the engine failed it: not the client's fault
            raise failed_request(acc.error)
    return accs


def choices_usage(
    ctx: ServingContext, job: EngineJob, completion_tokens: int, cached_tokens: int
) -> UsageInfo:
    """Usage of an answer: the prompt once (as vLLM counts n > 1), every choice's
    completion tokens; cached tokens are choice 0's (the one that computed the prompt)."""
    return make_usage(ctx, len(job.prompt_token_ids), completion_tokens, cached_tokens)


async def whole_response(
    ctx: ServingContext,
    job: EngineJob,
    request: Request,
    *,
    response_type: type[CompletionResponse] | type[ChatCompletionResponse],
    response_id: str,
    model: str,
    make_choice: Callable[[Accumulated, int], Any],
    extra: Callable[[list[Accumulated]], dict[str, Any]] | None = None,
) -> Response:
    """The non-streaming answer of either endpoint: one choice per sample
    (``make_choice`` of its whole output and its index) in a ``response_type`` body
    with usage, the engine's ``kv_transfer_params`` (choice 0's) and ``extra``'s fields;
    499 when the client went away, 500 when the engine failed."""
    accs = await run_choices(ctx, job, request)
    if accs is None:
        return Response(status_code=CLIENT_CLOSED)
    kv = accs[0].kv_transfer_params
    body = response_type(
        id=response_id,
        model=model,
        choices=[make_choice(acc, i) for i, acc in enumerate(accs)],
        usage=choices_usage(
            ctx, job, sum(len(a.token_ids) for a in accs), accs[0].num_cached_tokens
        ),
        kv_transfer_params=kv.to_dict() if kv is not None else None,
        **(extra(accs) if extra is not None else {}),
    )
    return Response(body.model_dump_json(), media_type="application/json")


async def open_choices(
    ctx: ServingContext, job: EngineJob, request: Request
) -> tuple[Choices, RequestOutput | None] | None:
    """:func:`open_stream` of every choice: started, with choice 0's first output (an
    engine rejection is still a plain HTTP 400). The caller owns the returned
    :class:`Choices` and must ``close`` them."""
    choices = Choices(ctx, job)
    first = await start_and_wait(ctx, choices, choices.requests[0].next_output, request)
    if first is None:
        return None
    out = first[0]
    if out is not None and any(c.finish_reason == "error" for c in out.outputs[:1]):
        choices.close()  # failed before its first token: a plain HTTP error, not a stream
        raise failed_request(out.error)
    return choices, out
