"""``POST /v1/completions``: one prompt (text or token ids) → ``n`` choices.

The engine request id is the HTTP request's id (``X-Request-Id`` or a minted one); the
response ``id`` is ``cmpl-<request id>``. ``kv_transfer_params`` from the engine's final
output are returned in the non-streaming response (the P/D proxy reads them there).

Order of the checks: the request's ``kv_transfer_params`` signature (403); a text
prompt that cannot fit ``max_model_len`` judged by its length alone (400, without
tokenizing it; skipped with ``truncate_prompt_tokens``, which keeps the last N tokens
after tokenization); tokenization in the blocking pool; the exact length and
``max_tokens`` checks; for a token-id prompt, the vocabulary.

``echo=true`` puts the prompt's text before the completion (a token-id or truncated
prompt is decoded); with ``logprobs`` it is refused: the echoed prompt's logprobs are
not merged into the choice's ``logprobs`` (``prompt_logprobs`` gives them).

With ``n`` > 1 every choice is rendered on its own (echo, logprobs' ``text_offset``);
``prompt_logprobs`` go in every choice (vLLM's field), streamed with each choice's
first chunk.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pdserve.frontend.outputs import CompletionOutput, RequestOutput
from pdserve.frontend.processor import min_token_count, too_long_text_message
from pdserve.serving.api.choices import whole_response
from pdserve.serving.api.generate import (
    Accumulated,
    EngineJob,
    check_constraint,
    check_fan_out,
    check_token_ids,
    render_prompt_logprobs,
    safe_logprob,
    token_strings,
)
from pdserve.serving.api.pd_params import verified_kv_params
from pdserve.serving.api.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    PromptLogprobs,
    RequestError,
)
from pdserve.serving.api.state import ServingContext
from pdserve.serving.api.streaming import stream_response


async def prepare_completion(
    ctx: ServingContext, req: CompletionRequest, request: Request
) -> EngineJob:
    """Verify, tokenize (off the event loop) and validate, in the order of the module
    docstring; raises :class:`APIError` (403) or :class:`RequestError` (400)."""
    engine = ctx.engine
    kv_params = verified_kv_params(req.kv_transfer_params, ctx.pd_secret)
    prompt = req.single_prompt()
    truncating = req.truncate_prompt_tokens is not None
    text: str | None
    if isinstance(prompt, str):
        low = min_token_count(engine.tokenizer, prompt)
        if low >= engine.max_model_len and not truncating:
            raise RequestError(too_long_text_message(prompt, low, engine.max_model_len), "prompt")
        ids = await ctx.run_blocking(
            engine.tokenizer.encode,
            prompt,
            add_special_tokens=req.add_special_tokens,
            job_size=len(prompt),
        )
        text = prompt
    else:
        ids, text = prompt, None
    if not ids:
        raise RequestError("prompt is empty (it has no tokens)", "prompt")
    if truncating:
        ids = req.truncated(list(ids), engine.max_model_len)
        text = None  # the engine gets the kept tokens only
    params = req.to_sampling_params(
        prompt_len=len(ids), max_model_len=engine.max_model_len, vocab_size=engine.vocab_size
    )
    if text is None:  # after the length check, so this scans at most max_model_len ids
        check_token_ids(ids, engine.vocab_size, "prompt")
    check_fan_out(params, kv_params)
    await check_constraint(ctx, req)
    return EngineJob(
        request_id=request.state.request_id,
        prompt=text,
        prompt_token_ids=list(ids),
        params=params,
        kv_transfer_params=kv_params,
        arrival_time=request.state.arrival_time,
    )


class _LogprobsBuilder:
    """OpenAI completion logprobs of the sampled tokens, with ``top_logprobs`` (token
    text -> logprob of the N most likely tokens, plus the sampled one as OpenAI and vLLM
    return it) when ``logprobs=N`` > 0; ``text_offset`` continues across stream deltas."""

    def __init__(self, ctx: ServingContext) -> None:
        self._tokenizer = ctx.engine.tokenizer
        self._offset = 0

    def build(
        self,
        token_ids: list[int],
        logprobs: list[float],
        top: list[dict[int, float]] | None = None,
    ) -> CompletionLogProbs:
        tokens = token_strings(self._tokenizer, token_ids)
        values = [safe_logprob(v) for v in logprobs]
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        top_lps: list[dict[str, float] | None] | None = None
        if top is not None:
            top_lps = []
            for tok, value, alts in zip(tokens, values, top, strict=False):
                names = token_strings(self._tokenizer, list(alts))
                entry = {
                    name: safe_logprob(v) for name, v in zip(names, alts.values(), strict=True)
                }
                entry.setdefault(tok, value)
                top_lps.append(entry)
        return CompletionLogProbs(
            text_offset=offsets, token_logprobs=list(values), tokens=tokens, top_logprobs=top_lps
        )


async def create_completion(
    ctx: ServingContext, req: CompletionRequest, request: Request
) -> Response:
    model = ctx.check_model(req.model)
    job = await prepare_completion(ctx, req, request)
    response_id = f"cmpl-{job.request_id}"
    builders = [_LogprobsBuilder(ctx) for _ in range(job.n)] if req.logprobs is not None else None

    def logprobs_of(
        index: int,
        token_ids: list[int],
        values: list[float] | None,
        top: list[dict[int, float]] | None,
    ) -> CompletionLogProbs | None:
        if builders is None or values is None:
            return None
        return builders[index].build(token_ids, values, top if req.logprobs else None)

    echo = ""  # echo=true: the prompt's text leads each answer (its first chunk streamed)
    if req.echo:
        if job.prompt is not None:
            echo = job.prompt
        else:
            skip = req.skip_special_tokens
            echo = await ctx.run_blocking(
                ctx.engine.tokenizer.decode,
                job.prompt_token_ids,
                skip_special_tokens=skip,
                job_size=len(job.prompt_token_ids),
            )
    tokenizer = ctx.engine.tokenizer

    if req.stream:
        started = [False] * job.n  # a choice's first chunk carries echo and prompt logprobs
        prompt_lps: list[PromptLogprobs | None] = [None]

        def on_first(first: RequestOutput) -> dict[str, Any]:
            prompt_lps[0] = render_prompt_logprobs(tokenizer, first.prompt_logprobs)
            return {}

        def stream_choice(c: CompletionOutput, index: int) -> CompletionStreamChoice:
            lead = not started[index]
            started[index] = True
            return CompletionStreamChoice(
                index=index,
                text=echo + c.text if lead else c.text,
                logprobs=logprobs_of(index, c.token_ids, c.logprobs, c.top_logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=prompt_lps[0] if lead else None,
            )

        return await stream_response(
            ctx,
            job,
            request,
            chunk_type=CompletionStreamResponse,
            response_id=response_id,
            model=model,
            options=req.stream_options,
            make_choice=stream_choice,
            first_extra=on_first if req.prompt_logprobs is not None else None,
        )

    rendered: list[PromptLogprobs | None] = []

    def whole_choice(acc: Accumulated, index: int) -> CompletionResponseChoice:
        if not rendered:  # the prompt's, from choice 0: the same for every choice
            rendered.append(render_prompt_logprobs(tokenizer, acc.prompt_logprobs))
        return CompletionResponseChoice(
            index=index,
            text=echo + acc.text,
            logprobs=logprobs_of(index, acc.token_ids, acc.logprobs, acc.top_logprobs),
            finish_reason=acc.finish_reason,
            stop_reason=acc.stop_reason,
            prompt_logprobs=rendered[0],
        )

    return await whole_response(
        ctx,
        job,
        request,
        response_type=CompletionResponse,
        response_id=response_id,
        model=model,
        make_choice=whole_choice,
    )
