"""``POST /v1/chat/completions``: messages → chat template → ``n`` choices.

The prompt is rendered with the tokenizer's ``apply_chat_template`` (see
:mod:`pdserve.serving.api.chat_template`) and encoded with ``add_special_tokens``
(default false: templates carry their own BOS), both in the blocking pool; a rendered
prompt whose length alone shows it cannot fit ``max_model_len`` is refused before it is
encoded. ``kv_transfer_params`` are verified first (403, :mod:`.pd_params`). The
first streamed chunk carries ``role: "assistant"`` together with the first text, so
every chunk carries a token (a role-only chunk would skew client TTFT/ITL).

Request ``tools`` reach the template; reasoning and tool calls are parsed out of the
output as :mod:`.chat_output` describes (a delta whose text a parser holds back sends
no chunk, unless it carries logprobs or the finish reason). ``truncate_prompt_tokens``
keeps the last N tokens of the rendered prompt.

With ``n`` > 1 each choice has its own output parser and its own first chunk (with
``role``); ``prompt_logprobs`` (vLLM's extension) go at the top of the response, or of
the stream's first chunk.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pdserve.frontend.outputs import CompletionOutput, RequestOutput
from pdserve.frontend.processor import InputProcessor
from pdserve.serving.api.chat_template import ChatTemplates
from pdserve.serving.api.choices import whole_response
from pdserve.serving.api.generate import (
    Accumulated,
    EngineJob,
    check_request,
    render_prompt_logprobs,
    safe_logprob,
    token_strings,
)
from pdserve.serving.api.pd_params import check_prompt_binding, verified_kv_params
from pdserve.serving.api.protocol import (
    CHAT_FIELDS,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatMessage,
    ChatMessageParam,
    DeltaMessage,
)
from pdserve.serving.api.state import ServingContext
from pdserve.serving.api.streaming import stream_response


def render_and_encode(
    chat: ChatTemplates,
    tokenizer: Any,
    messages: list[ChatMessageParam],
    *,
    add_generation_prompt: bool,
    add_special_tokens: bool,
    template_kwargs: dict[str, Any] | None,
    length_check: InputProcessor | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """Blocking: the rendered prompt and its token ids. With ``length_check``, a prompt
    that cannot fit ``max_model_len`` by its length alone is refused unencoded
    (:meth:`InputProcessor.check_text_length`)."""
    text = chat.render(
        tokenizer,
        messages,
        add_generation_prompt=add_generation_prompt,
        template_kwargs=template_kwargs,
        tools=tools,
    )
    if length_check is not None:
        length_check.check_text_length(text, "messages")
    return text, list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def chat_size(messages: list[ChatMessageParam]) -> int:
    """Characters of message content: what rendering and encoding them costs."""
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content is not None:
            total += sum(len(part.text) for part in m.content)
    return total


async def prepare_chat(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request: Request,
    fields: dict[str, str] = CHAT_FIELDS,
) -> EngineJob:
    """Verify, render, tokenize and check (``fields``: the endpoint's names of the
    fields the input processor's rules name); raises 403 or 400."""
    engine = ctx.engine
    kv_params = verified_kv_params(req.kv_transfer_params, ctx.pd_secret, request.state.request_id)
    ctx.parsing.check_request(req)
    truncating = req.truncate_prompt_tokens is not None
    text, ids = await ctx.run_blocking(
        render_and_encode,
        ctx.chat,
        engine.tokenizer,
        req.messages,
        add_generation_prompt=req.add_generation_prompt,
        add_special_tokens=req.add_special_tokens,
        template_kwargs=req.chat_template_kwargs,
        length_check=None if truncating else engine.processor,
        tools=req.tool_dicts(),
        job_size=chat_size(req.messages),
    )
    if truncating:
        ids = req.truncated(ids, engine.max_model_len)
    # 403: params issued for another prompt, or used before (then spent)
    check_prompt_binding(kv_params, ids, req.kv_transfer_params, ctx.pd_nonces)
    params = req.to_sampling_params(
        prompt_len=len(ids), max_model_len=engine.max_model_len, vocab_size=engine.vocab_size
    )
    await check_request(ctx, req, ids, params, kv_params, fields)
    return EngineJob(
        request_id=request.state.request_id,
        prompt=text,
        prompt_token_ids=ids,
        params=params,
        kv_transfer_params=kv_params,
        arrival_time=request.state.arrival_time,
    )


def _chat_logprobs(
    ctx: ServingContext,
    token_ids: list[int],
    values: list[float] | None,
    top: list[dict[int, float]] | None = None,
) -> ChatCompletionLogProbs | None:
    if values is None:
        return None
    tokenizer = ctx.engine.tokenizer
    tokens = token_strings(tokenizer, token_ids)
    content = []
    for j, (t, v) in enumerate(zip(tokens, values, strict=False)):
        alts = []
        if top is not None and j < len(top):
            names = token_strings(tokenizer, list(top[j]))
            alts = [
                ChatLogProb(token=n, logprob=safe_logprob(a), bytes=list(n.encode("utf-8")))
                for n, a in zip(names, top[j].values(), strict=True)
            ]
        content.append(
            ChatLogProbsContent(
                token=t,
                logprob=safe_logprob(v),
                bytes=list(t.encode("utf-8")),
                top_logprobs=alts,
            )
        )
    return ChatCompletionLogProbs(content=content)


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, request: Request
) -> Response:
    model = ctx.check_model(req.model)
    job = await prepare_chat(ctx, req, request)
    response_id = f"chatcmpl-{job.request_id}"
    want_logprobs = req.logprobs
    parsers = [ctx.parsing.for_request(req, job.prompt) for _ in range(job.n)]
    tokenizer = ctx.engine.tokenizer

    if req.stream:
        sent_role = [False] * job.n

        def stream_choice(c: CompletionOutput, index: int) -> list[ChatCompletionStreamChoice]:
            parser = parsers[index]
            last = c.finish_reason is not None
            if parser.active:
                deltas = parser.feed(c.text, last=last)
                if not deltas and (last or (want_logprobs and c.token_ids)):
                    deltas = [DeltaMessage()]
            else:
                deltas = [DeltaMessage(content=c.text)]
            choices = []
            for i, delta in enumerate(deltas):
                if not sent_role[index]:
                    delta.role = "assistant"
                    sent_role[index] = True
                is_last = i == len(deltas) - 1
                choices.append(
                    ChatCompletionStreamChoice(
                        index=index,
                        delta=delta,
                        logprobs=(
                            _chat_logprobs(ctx, c.token_ids, c.logprobs, c.top_logprobs)
                            if want_logprobs and i == 0
                            else None
                        ),
                        finish_reason=parser.finish_reason(c.finish_reason) if is_last else None,
                        stop_reason=c.stop_reason if is_last else None,
                    )
                )
            return choices

        def on_first(first: RequestOutput) -> dict[str, Any]:
            return {"prompt_logprobs": render_prompt_logprobs(tokenizer, first.prompt_logprobs)}

        return await stream_response(
            ctx,
            job,
            request,
            chunk_type=ChatCompletionStreamResponse,
            response_id=response_id,
            model=model,
            options=req.stream_options,
            make_choice=stream_choice,
            first_extra=on_first if req.prompt_logprobs is not None else None,
        )

    def whole_choice(acc: Accumulated, index: int) -> ChatCompletionResponseChoice:
        parser = parsers[index]
        if parser.active:
            message = parser.whole(acc.text)
        else:
            message = ChatMessage(role="assistant", content=acc.text)
        return ChatCompletionResponseChoice(
            index=index,
            message=message,
            logprobs=_chat_logprobs(ctx, acc.token_ids, acc.logprobs, acc.top_logprobs)
            if want_logprobs
            else None,
            finish_reason=parser.finish_reason(acc.finish_reason),
            stop_reason=acc.stop_reason,
        )

    def top_fields(accs: list[Accumulated]) -> dict[str, Any]:
        if req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": render_prompt_logprobs(tokenizer, accs[0].prompt_logprobs)}

    return await whole_response(
        ctx,
        job,
        request,
        response_type=ChatCompletionResponse,
        response_id=response_id,
        model=model,
        make_choice=whole_choice,
        extra=top_fields,
    )
