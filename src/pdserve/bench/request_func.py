"""Streaming OpenAI-API request functions with ``vllm bench serve``'s timing rules.

``st = perf_counter()`` right before the POST; every SSE event is timestamped
with the ``perf_counter()`` of the read that completed it. An event counts as a
token chunk when its JSON has a non-empty ``choices`` list, whatever the text
(empty text from special tokens still stops the TTFT clock). TTFT = first token
chunk - st; ITL = gaps between consecutive token chunks; latency (E2EL) = last
token chunk - st, so the usage-only chunk and ``[DONE]`` never extend it. Usage
is read from any chunk carrying ``usage`` (the last one wins).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal, Protocol

import aiohttp

from pdserve.bench.records import RequestInput, RequestOutput
from pdserve.bench.sse import SSEDecoder

Backend = Literal["openai", "openai-chat"]
BACKENDS: tuple[Backend, ...] = ("openai", "openai-chat")
DEFAULT_ENDPOINTS: dict[str, str] = {
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
_ENDPOINT_SUFFIX: dict[str, str] = {"openai": "completions", "openai-chat": "chat/completions"}
NO_CHOICES_ERROR = (
    "Never received a valid chunk to calculate TTFT. This response will be marked as failed!"
)
_MAX_ERROR_BODY = 2000


class ProgressLike(Protocol):
    def update(self, n: int = 1) -> object: ...


class RequestFunc(Protocol):
    async def __call__(
        self,
        request: RequestInput,
        session: aiohttp.ClientSession,
        pbar: ProgressLike | None = None,
    ) -> RequestOutput: ...


def check_endpoint(backend: str, api_url: str) -> None:
    """Refuse an endpoint that does not match the backend's API (vLLM does the same)."""
    suffix = _ENDPOINT_SUFFIX[backend]
    if not api_url.rstrip("/").endswith(suffix):
        raise ValueError(
            f"backend {backend!r} needs an endpoint ending in {suffix!r} "
            f"(got {api_url!r}); use --endpoint {DEFAULT_ENDPOINTS[backend]}"
        )
    if backend == "openai" and api_url.rstrip("/").endswith("chat/completions"):
        raise ValueError(
            f"backend 'openai' (completions) cannot use the chat endpoint {api_url!r}; "
            "use --backend openai-chat"
        )


def _completion_text(choice: dict[str, Any]) -> str:
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _chat_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        content = delta.get("content")
        if isinstance(content, str):
            return content
    return ""


def _headers(request: RequestInput) -> dict[str, str]:
    headers = dict(request.headers)
    if request.request_id:
        headers["x-request-id"] = request.request_id
    return headers


async def _stream(
    payload: dict[str, Any],
    request: RequestInput,
    session: aiohttp.ClientSession,
    pbar: ProgressLike | None,
    text_of: Callable[[dict[str, Any]], str],
) -> RequestOutput:
    if request.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(request.extra_body)
    headers = _headers(request)
    out = RequestOutput(prompt_len=request.prompt_len)
    pieces: list[str] = []
    st = time.perf_counter()
    out.start_time = st
    last = st
    first = True
    try:
        async with session.post(request.api_url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text(errors="replace"))[:_MAX_ERROR_BODY]
                out.error = f"HTTP {resp.status} {resp.reason or ''}: {body}".strip()
            else:
                decoder = SSEDecoder()
                async for raw in resp.content.iter_any():
                    now = time.perf_counter()
                    for data in decoder.feed(raw):
                        last, first = _on_event(data, now, st, last, first, out, pieces, text_of)
                now = time.perf_counter()
                for data in decoder.flush():
                    last, first = _on_event(data, now, st, last, first, out, pieces, text_of)
                out.generated_text = "".join(pieces)
                if first:
                    out.error = NO_CHOICES_ERROR
                else:
                    out.success = True
                    out.latency = last - st
    except Exception as exc:  # any failure of one request is recorded, never raised
        out.success = False
        out.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    if pbar is not None:
        pbar.update(1)
    return out


def _on_event(
    data: str,
    now: float,
    st: float,
    last: float,
    first: bool,
    out: RequestOutput,
    pieces: list[str],
    text_of: Callable[[dict[str, Any]], str],
) -> tuple[float, bool]:
    """Apply one SSE payload; returns the updated (last token time, still-waiting-first)."""
    data = data.strip()
    if not data or data == "[DONE]":
        return last, first
    obj = json.loads(data)
    if not isinstance(obj, dict):
        return last, first
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            out.output_tokens = int(usage["completion_tokens"])
        if isinstance(usage.get("prompt_tokens"), int):
            out.prompt_len = int(usage["prompt_tokens"])
    choices = obj.get("choices")
    if not choices or not isinstance(choices, list):
        # vLLM's rule: an in-stream error event does not by itself fail the request;
        # it is kept in ``error`` for visibility.
        if obj.get("error") is not None:
            out.error = f"error event in stream: {obj['error']}"
        return last, first
    if first:
        out.ttft = now - st
        first = False
    else:
        out.itl.append(now - last)
    choice = choices[0]
    if isinstance(choice, dict):
        pieces.append(text_of(choice))
    return now, first


async def request_openai_completions(
    request: RequestInput,
    session: aiohttp.ClientSession,
    pbar: ProgressLike | None = None,
) -> RequestOutput:
    """POST a streaming ``/v1/completions`` request (``prompt``, ``max_tokens``)."""
    payload: dict[str, Any] = {
        "model": request.model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return await _stream(payload, request, session, pbar, _completion_text)


async def request_openai_chat_completions(
    request: RequestInput,
    session: aiohttp.ClientSession,
    pbar: ProgressLike | None = None,
) -> RequestOutput:
    """POST a streaming ``/v1/chat/completions`` request (one user message)."""
    payload: dict[str, Any] = {
        "model": request.model,
        "messages": [{"role": "user", "content": request.prompt}],
        "max_completion_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return await _stream(payload, request, session, pbar, _chat_text)


REQUEST_FUNCS: dict[str, RequestFunc] = {
    "openai": request_openai_completions,
    "openai-chat": request_openai_chat_completions,
}
