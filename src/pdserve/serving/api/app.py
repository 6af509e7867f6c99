"""The OpenAI-compatible HTTP front end of one pdserve instance.

``build_app`` wires an :class:`~pdserve.serving.api.engine_client.EngineClient` into a
FastAPI app; ``serve_app`` (from :mod:`pdserve.serving.api.server`) runs it under
uvicorn with graceful SIGTERM draining.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST
/v1/responses`` (JSON or SSE), ``GET /v1/models``, ``GET /v1/models/{id}`` (404 for a
model not served), ``POST /tokenize``, ``POST /detokenize``, ``GET /health``,
``GET /metrics``, ``GET /version``. Chat output parsing (reasoning, tool calls) follows
``reasoning_parser``, ``tool_call_parser`` and ``enable_auto_tool_choice``
(:mod:`.chat_output`). With an API key, every route except ``/health``,
``/metrics``, ``/version`` and the OpenAPI docs needs ``Authorization: Bearer <key>``
(``/tokenize`` and ``/detokenize`` included). Request bodies over
``max_request_body_bytes`` get 413 before they are read; ``kv_transfer_params`` not
signed with ``pd_secret`` get 403 (:mod:`.middleware`, :mod:`.pd_params`); fields whose
cost grows with their size (``bad_words``, ``logit_bias``, ``allowed_token_ids``, stop
lists, tools, chat messages and their parts) are bounded before the body is parsed
(400 naming the field and the limit, :mod:`.field_limits`).

The app never runs model work and never blocks its event loop on a large input:
tokenization, chat-template rendering, detokenization and large ``/tokenize`` answers
run in a bounded thread pool owned by the app (:mod:`.workers`, closed at lifespan
shutdown); the engine is only awaited. The app does not own the engine: whoever built
the engine shuts it down after ``serve_app`` returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

import pdserve
from pdserve.metrics.prometheus import PrometheusMetrics
from pdserve.serving.api.chat import chat_size, create_chat_completion, render_and_encode
from pdserve.serving.api.chat_output import OutputParsing
from pdserve.serving.api.chat_template import ChatTemplates
from pdserve.serving.api.completions import create_completion
from pdserve.serving.api.completions_batch import create_batched_completion
from pdserve.serving.api.errors import APIError, install_exception_handlers
from pdserve.serving.api.field_limits import LimitedRoute
from pdserve.serving.api.generate import token_strings
from pdserve.serving.api.leak_plant import install_leak_plant
from pdserve.serving.api.middleware import DEFAULT_MAX_REQUEST_BODY_BYTES, ServingMiddleware
from pdserve.serving.api.pd_params import verify_release
from pdserve.serving.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ReleaseKVRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from pdserve.serving.api.protocol_responses import ResponsesRequest
from pdserve.serving.api.responses import create_response
from pdserve.serving.api.state import ServingContext
from pdserve.serving.api.workers import DEFAULT_THREADS, BlockingPool

if TYPE_CHECKING:
    from pdserve.serving.api.engine_client import EngineClient

__all__ = ["build_app"]

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    413: {"model": ErrorResponse, "description": "request body over the size limit"},
    503: {"model": ErrorResponse, "description": "shutting down"},
}
# routes that take kv_transfer_params
_PD_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    403: {"model": ErrorResponse, "description": "kv_transfer_params not signed by the proxy"},
}
_JSON_OR_SSE: dict[str, Any] = {"content": {"application/json": {}, "text/event-stream": {}}}


def build_app(
    engine: EngineClient,
    *,
    served_model_names: list[str],
    api_key: str | None = None,
    enable_prompt_tokens_details: bool = False,
    chat_template: str | None = None,
    chat_template_content_format: str = "auto",
    metrics: PrometheusMetrics | None = None,
    health_check_timeout: float = 5.0,
    pd_secret: bytes | None = None,
    max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
    tokenizer_threads: int = DEFAULT_THREADS,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    metrics_vllm_aliases: bool = False,
) -> FastAPI:
    """A FastAPI app serving ``engine``. ``pd_secret`` is the topology's P/D secret
    (``pd_auth.load_secret()``); without it every ``kv_transfer_params`` is refused.
    ``max_request_body_bytes=None`` lifts the body limit. Raises ``ValueError`` for bad
    settings (no model name, unreadable ``chat_template`` file, unknown content format,
    a limit or thread count below the minimum, an unknown parser,
    ``enable_auto_tool_choice`` without a tool-call parser). ``metrics_vllm_aliases``
    adds ``vllm:`` copies of the key series when the app builds its own metrics."""
    names = [n for n in served_model_names if n]
    if not names:
        raise ValueError("served_model_names must name at least one model")
    chat = ChatTemplates(chat_template, chat_template_content_format)
    parsing = OutputParsing(reasoning_parser, tool_call_parser, enable_auto_tool_choice)
    if metrics is None:
        metrics = PrometheusMetrics(
            names[0],
            stats_provider=engine.latest_stats,
            max_model_len=engine.max_model_len,
            vllm_aliases=metrics_vllm_aliases,
        )
    ctx = ServingContext(
        engine=engine,
        served_model_names=names,
        metrics=metrics,
        chat=chat,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        version=pdserve.__version__,
        pd_secret=pd_secret,
        pool=BlockingPool(tokenizer_threads),
        parsing=parsing,
    )
    if max_request_body_bytes is not None and max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes}")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            ctx.close()

    app = FastAPI(title="pdserve", version=ctx.version, lifespan=lifespan)
    app.router.route_class = LimitedRoute  # bounded fields before parsing (field_limits)
    app.state.pdserve = ctx
    install_exception_handlers(app)
    app.add_middleware(
        ServingMiddleware,
        state=ctx.state,
        api_key=api_key,
        max_body_bytes=max_request_body_bytes,
    )
    _add_routes(app, ctx, health_check_timeout)
    _document_400_not_422(app)
    install_leak_plant(app)  # test-only; a no-op unless its variable is set (leak_plant.py)
    return app


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents 422 for every body; this app answers validation errors with 400."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    if isinstance(op, dict):
                        op.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_routes(app: FastAPI, ctx: ServingContext, health_timeout: float) -> None:
    engine = ctx.engine

    @app.post("/v1/completions", responses={**_PD_ERRORS, 200: _JSON_OR_SSE})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if len(body.prompts()) > 1:
            return await create_batched_completion(ctx, body, request)
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", responses={**_PD_ERRORS, 200: _JSON_OR_SSE})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    @app.post("/v1/responses", responses={**_PD_ERRORS, 200: _JSON_OR_SSE})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(ctx, body, request)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=ctx.default_model, max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in ctx.served_model_names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def model_card(model_id: str) -> ModelCard:
        if model_id not in ctx.served_model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model")
        return card(model_id)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> Response:
        """Token ids of a prompt or a chat; a text that cannot fit ``max_model_len`` by
        its length alone is refused (400) without being tokenized."""
        ctx.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            size = chat_size(body.messages)
        else:
            size = len(body.prompt)
            engine.processor.check_text_length(body.prompt, "prompt")
        # tokenizing, token strings and the JSON of a long answer: all off the loop
        data = await ctx.run_blocking(_tokenize_json, ctx, body, job_size=size)
        return Response(data, media_type="application/json")

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        text = await ctx.run_blocking(_detokenize, ctx, body.tokens, job_size=len(body.tokens))
        return DetokenizeResponse(prompt=text)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> dict[str, str]:
        """``{"status": "ok"}`` while the engine is healthy, else 503 saying why."""
        try:
            await asyncio.wait_for(engine.check_health(), timeout=health_timeout)
        except Exception as e:
            raise APIError(503, f"engine is unhealthy: {e!r}") from e
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = ctx.metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    @app.post("/v1/kv_transfer/release", responses=_ERRORS)
    async def release_kv(body: ReleaseKVRequest) -> dict[str, str]:
        """Prefill side: the proxy gave a request up; free the KV held for its decode."""
        verify_release(body.model_dump(exclude_none=True), ctx.pd_secret, ctx.pd_nonces)
        release = getattr(engine, "release_kv", None)
        if release is None:
            raise APIError(404, "this engine holds no KV for remote decode")
        await release(body.request_id)
        return {"request_id": body.request_id, "status": "release requested"}

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=ctx.version)


def _tokenize_json(ctx: ServingContext, body: TokenizeRequest) -> bytes:
    """Blocking: the ``/tokenize`` answer as JSON."""
    tok, engine = ctx.engine.tokenizer, ctx.engine
    if isinstance(body, TokenizeChatRequest):
        _, ids = render_and_encode(
            ctx.chat,
            tok,
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            add_special_tokens=body.add_special_tokens,
            template_kwargs=body.chat_template_kwargs,
            length_check=engine.processor,
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        )
    else:
        ids = list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    strs = token_strings(tok, ids) if body.return_token_strs else None
    answer = TokenizeResponse(
        count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs
    )
    return answer.model_dump_json().encode()


def _detokenize(ctx: ServingContext, tokens: list[int]) -> str:
    """Blocking: the text of ``tokens`` (400 for ids outside the vocabulary)."""
    ctx.engine.processor.check_token_ids(tokens, "tokens")
    return str(ctx.engine.tokenizer.decode(tokens))
