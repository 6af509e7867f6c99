"""``POST /v1/completions``: one prompt (text or token ids) → ``n`` choices.

The engine request id is the HTTP request's id (``X-Request-Id`` or a minted one); the
response ``id`` is ``cmpl-<request id>``. ``kv_transfer_params`` from the engine's final
output are returned in the non-streaming response (the P/D proxy reads them there).

Order of the checks: the request's ``kv_transfer_params`` signature (403); a text
prompt that cannot fit ``max_model_len`` judged by its length alone (400, without
tokenizing it; skipped with ``truncate_prompt_tokens``, which keeps the last N tokens
after tokenization); tokenization in the blocking pool; the binding of the
``kv_transfer_params`` to the prompt (403); the input processor's rules
(:mod:`pdserve.frontend.processor`: lengths, vocabulary, sampling values, P/D limits;
400); the output constraint's grammar (400).

``echo=true`` puts the prompt's text before the completion (a token-id or truncated
prompt is decoded); with ``logprobs=N`` the choice's ``logprobs`` cover the prompt's
tokens first (the engine computes the prompt's logprobs, at least N of them;
:mod:`pdserve.serving.api.completion_logprobs`). ``max_tokens=0`` (with ``echo`` only)
answers the prompt alone, scored: the engine samples one token that the answer leaves
out (``finish_reason`` ``length``, no completion tokens in ``usage``). Prompt logprobs
cannot be computed on a P/D decode leg, so echo with logprobs is refused there (400,
``echo``) as ``prompt_logprobs`` is.

With ``n`` > 1 every choice is rendered on its own (echo, logprobs' ``text_offset``);
``prompt_logprobs`` (when the client asked for them) go in every choice (vLLM's field),
streamed with each choice's first chunk, where the echoed prompt's logprobs go too.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pdserve.frontend.outputs import CompletionOutput, PromptLogprobList, RequestOutput
from pdserve.serving.api.choices import whole_response
from pdserve.serving.api.completion_logprobs import (
    LogprobsBuilder,
    TokenNames,
    echoed_prompt,
    trimmed,
)
from pdserve.serving.api.generate import (
    Accumulated,
    EngineJob,
    check_request,
    render_prompt_logprobs,
)
from pdserve.serving.api.pd_params import check_prompt_binding, verified_kv_params
from pdserve.serving.api.protocol import (
    COMPLETION_FIELDS,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    PromptLogprobs,
)
from pdserve.serving.api.state import ServingContext
from pdserve.serving.api.streaming import stream_response

# a choice's prompt_logprobs field, and the echoed prompt's logprobs that lead its logprobs
_PromptParts = tuple[PromptLogprobs | None, CompletionLogProbs | None]


async def prepare_completion(
    ctx: ServingContext, req: CompletionRequest, request: Request
) -> EngineJob:
    """Verify, tokenize (off the event loop) and validate, in the order of the module
    docstring; raises :class:`APIError` (403) or :class:`RequestError` (400)."""
    engine = ctx.engine
    kv_params = verified_kv_params(req.kv_transfer_params, ctx.pd_secret, request.state.request_id)
    prompt = req.single_prompt()
    truncating = req.truncate_prompt_tokens is not None
    text: str | None
    if isinstance(prompt, str):
        if not truncating:
            engine.processor.check_text_length(prompt, "prompt")
        ids = await ctx.run_blocking(
            engine.tokenizer.encode,
            prompt,
            add_special_tokens=req.add_special_tokens,
            job_size=len(prompt),
        )
        text = prompt
    else:
        ids, text = prompt, None
    if truncating:
        ids = req.truncated(list(ids), engine.max_model_len)
        text = None  # the engine gets the kept tokens only
    # 403: params issued for another prompt, or used before (then spent)
    check_prompt_binding(kv_params, ids, req.kv_transfer_params, ctx.pd_nonces)
    params = req.to_sampling_params(
        prompt_len=len(ids), max_model_len=engine.max_model_len, vocab_size=engine.vocab_size
    )
    fields = COMPLETION_FIELDS
    if req.prompt_logprobs is None:  # the prompt's logprobs were asked for by echo
        fields = {**fields, "prompt_logprobs": "echo"}
    await check_request(ctx, req, ids, params, kv_params, fields)
    return EngineJob(
        request_id=request.state.request_id,
        prompt=text,
        prompt_token_ids=list(ids),
        params=params,
        kv_transfer_params=kv_params,
        arrival_time=request.state.arrival_time,
        score_only=req.max_tokens == 0,
    )


async def create_completion(
    ctx: ServingContext, req: CompletionRequest, request: Request
) -> Response:
    model = ctx.check_model(req.model)
    job = await prepare_completion(ctx, req, request)
    return await answer_completion(ctx, req, request, job, model)


async def answer_completion(
    ctx: ServingContext, req: CompletionRequest, request: Request, job: EngineJob, model: str
) -> Response:
    """Run a prepared ``job`` and answer it (JSON, or SSE when ``req.stream``)."""
    response_id = f"cmpl-{job.request_id}"
    tokenizer = ctx.engine.tokenizer
    names = TokenNames(tokenizer)
    builders = [LogprobsBuilder(names) for _ in range(job.n)] if req.logprobs is not None else None

    def logprobs_of(
        index: int,
        token_ids: list[int],
        values: list[float] | None,
        top: list[dict[int, float]] | None,
        lead: CompletionLogProbs | None,
    ) -> CompletionLogProbs | None:
        if builders is None:
            return None
        if values is None:  # no tokens (a request that ended before its first one)
            if lead is None:
                return None
            token_ids, values, top = [], [], None
        return builders[index].build(token_ids, values, top if req.logprobs else None, lead)

    def prompt_parts(plp: PromptLogprobList | None) -> _PromptParts:
        """The choices' ``prompt_logprobs`` (as the client asked for them) and the
        echoed prompt's logprobs (echo with logprobs), once for every choice."""
        shown = None
        if req.prompt_logprobs is not None:
            shown = render_prompt_logprobs(tokenizer, trimmed(plp, req.prompt_logprobs))
        echoed = None
        if req.echo and req.logprobs is not None:
            echoed = echoed_prompt(names, job.prompt_token_ids, plp, req.logprobs)
        return shown, echoed

    echo = ""  # echo=true: the prompt's text leads each answer (its first chunk streamed)
    if req.echo:
        if job.prompt is not None:
            echo = job.prompt
        else:
            skip = req.skip_special_tokens
            echo = await ctx.run_blocking(
                tokenizer.decode,
                job.prompt_token_ids,
                skip_special_tokens=skip,
                job_size=len(job.prompt_token_ids),
            )

    if req.stream:
        started = [False] * job.n  # a choice's first chunk carries echo and prompt logprobs
        parts: _PromptParts = (None, None)

        def on_first(first: RequestOutput) -> dict[str, Any]:
            nonlocal parts
            parts = prompt_parts(first.prompt_logprobs)
            return {}

        def stream_choice(c: CompletionOutput, index: int) -> CompletionStreamChoice:
            lead = not started[index]
            started[index] = True
            shown, echoed = parts if lead else (None, None)
            return CompletionStreamChoice(
                index=index,
                text=echo + c.text if lead else c.text,
                logprobs=logprobs_of(index, c.token_ids, c.logprobs, c.top_logprobs, echoed),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=shown,
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
            first_extra=on_first if job.params.prompt_logprobs is not None else None,
        )

    rendered: list[_PromptParts] = []

    def whole_choice(acc: Accumulated, index: int) -> CompletionResponseChoice:
        if not rendered:  # the prompt's, from choice 0: the same for every choice
            rendered.append(prompt_parts(acc.prompt_logprobs))
        shown, echoed = rendered[0]
        return CompletionResponseChoice(
            index=index,
            text=echo + acc.text,
            logprobs=logprobs_of(index, acc.token_ids, acc.logprobs, acc.top_logprobs, echoed),
            finish_reason=acc.finish_reason,
            stop_reason=acc.stop_reason,
            prompt_logprobs=shown,
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
