"""What completions and chat completions share: the engine requests of one HTTP
request (one per choice), client-disconnect handling, the non-streaming answer, usage
and logprobs. Streaming answers are rendered by :mod:`pdserve.serving.api.streaming`.

Ownership and lifecycle of an engine request (:class:`EngineRequest`):

    start()  -- registers the request id, calls ``engine.generate`` (ValueError → 400)
    next_output() ...  -- delta outputs; per-request metrics are recorded here
    close()  -- always, exactly once effective: aborts the engine request unless it
                finished, closes the engine's iterator, releases the request id.

``close`` never awaits (it spawns the abort), so it is safe in ``finally`` blocks of
cancelled tasks. A client disconnect cancels the task that consumes the outputs
(:func:`run_until_disconnect`); the cancellation unwinds into ``close``, which aborts.

The choices of one HTTP request (``n``) are :mod:`pdserve.serving.api.choices`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.types import Receive

from pdserve.core_types.kv_connector import KV_LOAD_FAILED
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.frontend.outputs import CompletionOutput, PromptLogprobList, RequestOutput
from pdserve.frontend.parallel import fan_out
from pdserve.metrics.prometheus import RequestMetrics
from pdserve.serving.api.errors import APIError
from pdserve.serving.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptLogprob,
    PromptLogprobs,
    PromptTokenUsageInfo,
    UsageInfo,
)
from pdserve.serving.api.state import ServingContext
from pdserve.serving.http import wait_for_disconnect

T = TypeVar("T")

logger = logging.getLogger(__name__)

# OpenAI clients cannot parse -inf; vLLM clamps the same way.
_MIN_LOGPROB = -9999.0

CLIENT_CLOSED = 499  # nobody reads it; the status only shows in access logs


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (waiting until it has
    unwound) and raise :class:`ClientDisconnected`. Only call after the request body
    has been read: from then on the ASGI ``receive`` only reports the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


def safe_logprob(value: float | None) -> float:
    """A JSON-safe logprob: NaN/-inf become -9999.0, anything above 0 becomes 0."""
    if value is None or math.isnan(value):
        return _MIN_LOGPROB
    return min(0.0, max(_MIN_LOGPROB, float(value)))


@dataclass
class EngineJob:
    """Everything the engine needs for one request, validated."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: KVTransferParams | None
    arrival_time: float
    # echo with max_tokens=0: the one token the engine samples is left out of the
    # answer, which ends with finish_reason "length" (:func:`without_tokens`)
    score_only: bool = False

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def delays_siblings(self) -> bool:
        """Choices after the first wait for its first output: their prompt's KV is the
        one the first pulls from a prefill instance."""
        kv = self.kv_transfer_params
        return self.n > 1 and kv is not None and kv.do_remote_prefill

    def children(self) -> list[EngineJob]:
        """One job per choice (this job itself when n is 1)."""
        if self.n == 1:
            return [self]
        return [
            EngineJob(
                rid,
                self.prompt,
                self.prompt_token_ids,
                params,
                self.kv_transfer_params if i == 0 else None,
                self.arrival_time,
                self.score_only,
            )
            for i, (rid, params) in enumerate(fan_out(self.request_id, self.params))
        ]


class EngineRequest:
    """One engine request owned by one HTTP request (see the module docstring)."""

    def __init__(self, ctx: ServingContext, job: EngineJob) -> None:
        self.ctx = ctx
        self.job = job
        self.tracker: RequestMetrics = ctx.metrics.start_request(
            job.arrival_time, len(job.prompt_token_ids)
        )
        self._it: AsyncIterator[RequestOutput] | None = None
        self._registered = False
        self.finished = False
        self._closed = False

    def start(self) -> None:
        job = self.job
        self.ctx.state.register(job.request_id)
        self._registered = True
        try:
            self._it = aiter(
                self.ctx.engine.generate(
                    job.request_id,
                    job.prompt,
                    job.prompt_token_ids,
                    job.params,
                    job.kv_transfer_params,
                )
            )
        except ValueError:
            self._rejected()
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    async def next_output(self) -> RequestOutput | None:
        """The next delta output, or ``None`` after the last one."""
        if self.finished or self._it is None:
            return None
        try:
            out = await anext(self._it)
        except StopAsyncIteration:
            self._mark_finished("abort")
            return None
        except ValueError:
            self._rejected()
            raise
        except Exception:
            self._mark_finished("error")
            raise
        n_new = sum(len(c.token_ids) for c in out.outputs)
        self.tracker.on_output(n_new)
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None)
            self._mark_finished(reason or ("error" if out.error else "stop"))
        return without_tokens(out) if self.job.score_only else out

    def _rejected(self) -> None:
        """The engine refused the request (``ValueError``): it never ran, so it is left
        out of the request metrics unless it had already produced tokens."""
        if self.tracker.num_generated == 0:
            self.tracker.discard()
        else:
            self.tracker.finish("error")

    def _mark_finished(self, reason: str) -> None:
        self.finished = True
        self.tracker.finish(reason)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        rid = self.job.request_id
        abort = not self.finished
        if abort:
            self.tracker.finish("abort")
        aclose = getattr(self._it, "aclose", None)
        if abort or aclose is not None:
            self.ctx.state.spawn(self._cleanup(abort, aclose), f"cleanup of request {rid}")
        if self._registered:
            self.ctx.state.unregister(rid)

    async def _cleanup(self, abort: bool, aclose: Callable[[], Awaitable[None]] | None) -> None:
        """Abort first (the engine frees the KV blocks), then close the output iterator."""
        try:
            if abort:
                await self.ctx.engine.abort(self.job.request_id)
        finally:
            if aclose is not None:
                await aclose()


def without_tokens(out: RequestOutput) -> RequestOutput:
    """``out`` with no generated tokens (``max_tokens=0``): a stop the engine saw in
    the token it sampled is reported as ``length``, as if none had been sampled."""
    outputs = []
    for c in out.outputs:
        reason, stop = c.finish_reason, c.stop_reason
        if reason == "stop":
            reason, stop = "length", None
        outputs.append(
            CompletionOutput(
                c.index,
                "",
                [],
                logprobs=None if c.logprobs is None else [],
                finish_reason=reason,
                stop_reason=stop,
                top_logprobs=None if c.top_logprobs is None else [],
            )
        )
    return dataclasses.replace(out, outputs=outputs)


@dataclass
class Accumulated:
    """A whole (non-streaming) completion, summed from delta outputs."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    prompt_logprobs: PromptLogprobList | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, out: RequestOutput) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.error:
            self.error = out.error
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        for c in out.outputs[:1]:
            self.parts.append(c.text)
            self.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                self.logprobs = (self.logprobs or []) + list(c.logprobs)
            if c.top_logprobs is not None:
                self.top_logprobs = (self.top_logprobs or []) + list(c.top_logprobs)
            if c.finish_reason is not None:
                self.finish_reason = c.finish_reason
                self.stop_reason = c.stop_reason


async def collect(er: EngineRequest, acc: Accumulated | None = None) -> Accumulated:
    acc = acc if acc is not None else Accumulated()
    while (out := await er.next_output()) is not None:
        acc.add(out)
    if acc.finish_reason is None:
        acc.finish_reason = "abort"
    return acc


def failed_request(error: str | None) -> APIError:
    """The error for a request the engine failed (not the client's fault): 503 when its
    prompt's KV could not be loaded from its prefill instance (the message says why:
    the lease was gone, the prefill died, ...), 500 for anything else."""
    message = f"the engine failed this request: {error or 'unknown error'}"
    return APIError(503 if (error or "").startswith(KV_LOAD_FAILED) else 500, message)


async def engine_failure(ctx: ServingContext, exc: BaseException) -> APIError:
    """The 500 for an engine that raised something other than ``ValueError``."""
    logger.error("engine error: %r", exc, exc_info=exc)
    try:
        await asyncio.wait_for(ctx.engine.check_health(), timeout=5.0)
    except Exception as dead:
        return APIError(500, f"the engine is not healthy: {dead!r}")
    return APIError(500, f"the engine failed this request: {exc!r}")


async def run_to_completion(
    ctx: ServingContext, job: EngineJob, request: Request
) -> Accumulated | None:
    """Non-streaming: the whole output, or ``None`` when the client went away (the
    engine request is aborted). Engine ``ValueError`` propagates (→ 400); any other
    engine exception, or a request the engine failed, becomes an :class:`APIError` 500."""
    er = EngineRequest(ctx, job)
    try:
        er.start()
        acc = await run_until_disconnect(request.receive, collect(er))
    except ClientDisconnected:
        return None
    except (ValueError, APIError):
        raise
    except Exception as e:
        raise await engine_failure(ctx, e) from e
    finally:
        er.close()
    if acc.finish_reason == "error":  # the engine failed it: not the client's fault
        raise failed_request(acc.error)
    return acc


async def open_stream(
    ctx: ServingContext, job: EngineJob, request: Request
) -> tuple[EngineRequest, RequestOutput | None] | None:
    """Streaming: start the request and wait for its first output before any byte is
    sent, so that an engine rejection is still a plain HTTP 400. Returns ``None`` when
    the client went away. The caller owns the returned request and must ``close`` it
    (the :class:`~pdserve.serving.api.streaming.SSEResponse` does)."""
    er = EngineRequest(ctx, job)
    first = await start_and_wait(ctx, er, er.next_output, request)
    return None if first is None else (er, first[0])


class _Startable(Protocol):
    def start(self) -> None: ...
    def close(self) -> None: ...


async def start_and_wait(
    ctx: ServingContext,
    handle: _Startable,
    first_output: Callable[[], Awaitable[RequestOutput | None]],
    request: Request,
) -> tuple[RequestOutput | None] | None:
    """Start ``handle`` and wait for ``first_output()`` (returned as a 1-tuple), or
    ``None`` when the client went away; on any failure ``handle`` is closed before the
    error propagates (an engine failure becomes its API error)."""
    try:
        handle.start()
        first = await run_until_disconnect(request.receive, first_output())
    except ClientDisconnected:
        handle.close()
        return None
    except (ValueError, APIError):
        handle.close()
        raise
    except Exception as e:
        handle.close()
        raise await engine_failure(ctx, e) from e
    except BaseException:
        handle.close()
        raise
    return (first,)


def make_usage(
    ctx: ServingContext, prompt_tokens: int, completion_tokens: int, cached_tokens: int
) -> UsageInfo:
    details = None
    if ctx.enable_prompt_tokens_details:
        details = PromptTokenUsageInfo(cached_tokens=cached_tokens)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=details,
    )


async def check_request(
    ctx: ServingContext,
    req: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    params: SamplingParams,
    kv: KVTransferParams | None,
    fields: Mapping[str, str],
) -> None:
    """The input processor's rules (400 naming the field, ``fields``: this endpoint's
    names of them), then the output constraint's grammar, built in the blocking pool
    (the first one imports xgrammar)."""
    found = req.constraint()
    if found is not None:
        fields = {**fields, "structured_outputs": found[1]}
    processor = ctx.engine.processor
    processor.check(ids, params, kv, names=fields)
    if found is not None:
        spec, param = found
        await ctx.run_blocking(processor.check_grammar, spec, param, job_size=len(spec.key()[1]))


def token_strings(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Per-token text for logprobs (special tokens kept)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


def render_prompt_logprobs(tokenizer: Any, plp: PromptLogprobList | None) -> PromptLogprobs | None:
    """The JSON shape of prompt logprobs: token id (as a string) -> logprob (JSON-safe),
    rank and decoded token (each distinct id decoded once)."""
    if plp is None:
        return None
    names: dict[int, str] = {}
    out: PromptLogprobs = []
    for entry in plp:
        if entry is None:
            out.append(None)
            continue
        row = {}
        for tid, lp in entry.items():
            if tid not in names:
                names[tid] = tokenizer.decode([tid], skip_special_tokens=False)
            row[str(tid)] = PromptLogprob(
                logprob=safe_logprob(lp.logprob), rank=lp.rank, decoded_token=names[tid]
            )
        out.append(row)
    return out


def now_s() -> int:
    return int(time.time())
