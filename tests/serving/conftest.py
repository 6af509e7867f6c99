"""Fixtures for the API-server tests: a fake tokenizer, a fake engine client, and the
app served by uvicorn on 127.0.0.1 (ephemeral port) in a background thread.

Everything is loopback-only and bounded: engines emit at most ``max_tokens`` tokens
with tiny sleeps, every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import jinja2.sandbox
import pytest

from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.pd_auth import load_secret, prompt_digest, sign_kv_params
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.core_types.scheduler_output import PromptLogprobs
from pdserve.core_types.stats import SchedulerStats
from pdserve.frontend.output_processor import prompt_logprob_list
from pdserve.frontend.outputs import CompletionOutput, PromptLogprobList, RequestOutput
from pdserve.frontend.processor import InputProcessor
from pdserve.serving.api.app import build_app
from pdserve.serving.api.server import ApiServer

MODEL = "fake-model"
FAKE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def pd_secret() -> bytes:
    """The session's P/D secret (tests/conftest.py sets ``PDSERVE_PD_SECRET``)."""
    secret = load_secret()
    assert secret is not None, "tests/conftest.py sets PDSERVE_PD_SECRET"
    return secret


def signed(
    kv: dict[str, Any],
    request_id: str | None = None,
    prompt_ids: list[int] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """``kv`` signed as this topology's proxy signs it, for the request ``request_id``
    (its ``X-Request-Id``); a decode leg's for the prompt ``prompt_ids`` too (its
    ``remote_prompt_digest``, as the prefill instance computes it)."""
    if prompt_ids is not None:
        kv = {**kv, "remote_prompt_digest": prompt_digest(prompt_ids)}
    return sign_kv_params(kv, pd_secret(), request_id=request_id, **kw)


def prompt_ids_of(url: str, body: dict[str, Any]) -> list[int]:
    """The prompt token ids the server at ``url`` makes of a completion's ``prompt`` or a
    chat's ``messages`` (its ``/tokenize``)."""
    import httpx

    keys = ("prompt",) if "prompt" in body else ("messages", "add_generation_prompt")
    r = httpx.post(f"{url}/tokenize", json={k: body[k] for k in keys if k in body}, timeout=10)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


class FakeTokenizer:
    """Characters <-> ids: printable Latin-1 char c has id ord(c); 0 is unknown, 1 BOS, 2 EOS."""

    BOS, EOS, UNK = 1, 2, 0
    vocab_size = 256
    eos_token_ids = frozenset({2})

    def __init__(self, chat_template: str | None = FAKE_CHAT_TEMPLATE) -> None:
        self.chat_template = chat_template
        self._env = jinja2.sandbox.ImmutableSandboxedEnvironment()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) if 32 <= ord(c) < 256 or c == "\n" else self.UNK for c in text]
        return ([self.BOS] if add_special_tokens else []) + ids

    def decode(self, ids: list[int] | int, skip_special_tokens: bool = True) -> str:
        out = []
        for i in [ids] if isinstance(ids, int) else ids:
            if i in (self.BOS, self.EOS):
                if not skip_special_tokens:
                    out.append("<s>" if i == self.BOS else "</s>")
            elif i == self.UNK:
                out.append("?")
            else:
                out.append(chr(i))
        return "".join(out)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("no chat template")
        return self._env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **kwargs
        )


def fake_prompt_logprobs(prompt_ids: list[int], n: int) -> PromptLogprobList:
    """The fake engine's prompt logprobs (vLLM's shape, as the output processor makes
    them): position p's actual token has rank ``p % 3 + 1``; the top ``n`` at ranks
    1..n are digits at -0.25, -0.5, ... (the actual token at its own rank, if <= n),
    an actual token below them has -4.0."""
    if not 0 <= n <= 20:
        raise ValueError(f"fake engine: prompt_logprobs={n}")
    rows = range(1, len(prompt_ids))
    ranks = [p % 3 + 1 for p in rows]
    top_ids = [
        [prompt_ids[p] if r + 1 == rank else ord("0") + (p + r) % 10 for r in range(n)]
        for p, rank in zip(rows, ranks, strict=True)
    ]
    top_lps = [[-0.25 * (r + 1) for r in range(n)] for _ in rows]
    actual = [-0.25 * rank if rank <= n else -4.0 for rank in ranks]
    return prompt_logprob_list(prompt_ids, PromptLogprobs(actual, ranks, top_ids, top_lps))


class FakeEngineClient:
    """Deterministic engine: output token i is ``'a' + i % 26``; one token per delta,
    ``token_delay`` seconds apart; the last delta carries ``finish_reason``; the first
    delta carries :func:`fake_prompt_logprobs` when they are asked for.

    Rejects (``ValueError``) prompts that are too long or hold ids outside the vocabulary
    at call time, and prompts containing ``REJECT`` at the first iteration; a prompt
    containing ``CRASH`` kills the engine after two tokens (RuntimeError). ``abort``
    records the id and makes the request's stream end with ``finish_reason="abort"``.
    """

    def __init__(
        self,
        tokenizer: Any | None = None,
        *,
        max_model_len: int = 128,
        token_delay: float = 0.001,
        num_cached_tokens: int = 3,
        script: str | None = None,
        script_chunk: int = 3,
    ) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else FakeTokenizer()
        self.vocab_size = int(self.tokenizer.vocab_size)
        self.max_model_len = max_model_len
        self.priority_scheduling = False
        self.token_delay = token_delay
        self.num_cached_tokens = num_cached_tokens
        # scripted output: this text in deltas of script_chunk characters (one "token"
        # per character), then finish_reason "stop"; None: the 'abc...' tokens
        self.script = script
        self.script_chunk = script_chunk
        self.healthy = True
        self.aborted: list[str] = []
        self.released: list[str] = []  # release_kv calls (the prefill side of P/D)
        self.requests: dict[str, tuple[list[int], SamplingParams, dict | None]] = {}
        self.running: set[str] = set()
        self._abort_events: dict[str, asyncio.Event] = {}
        self._sent_prompt_logprobs: set[str] = set()

    @property
    def processor(self) -> InputProcessor:
        """The real input processor, over this fake's current settings."""
        return InputProcessor(
            self.tokenizer,
            self.max_model_len,
            self.vocab_size,
            priority_scheduling=self.priority_scheduling,
        )

    async def release_kv(self, request_id: str) -> None:
        self.released.append(request_id)

    def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError("fake engine: prompt too long")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError("fake engine: token id outside the vocabulary")
        self.requests[request_id] = (list(prompt_token_ids), params, kv_transfer_params)
        return self._run(request_id, prompt, prompt_token_ids, params, kv_transfer_params)

    async def _run(
        self,
        rid: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        kv: KVTransferParams | None,
    ) -> AsyncIterator[RequestOutput]:
        if prompt is not None and "REJECT" in prompt:
            raise ValueError("fake engine rejects this prompt")
        event = self._abort_events.setdefault(rid, asyncio.Event())
        self.running.add(rid)
        max_tokens = params.max_tokens or (self.max_model_len - len(prompt_ids))
        try:
            if self.script is not None:
                text, n = self.script, self.script_chunk
                pieces = [text[i : i + n] for i in range(0, len(text), n)] or [""]
                for j, piece in enumerate(pieces):
                    await asyncio.sleep(self.token_delay)
                    reason = "stop" if j == len(pieces) - 1 else None
                    ids = [min(ord(ch), 255) for ch in piece]
                    yield self._out(rid, prompt, prompt_ids, ids, piece, reason, None, params)
                return
            for i in range(max_tokens):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout=self.token_delay)
                if event.is_set():
                    self.running.discard(rid)  # like the engine: stats leave it before the output
                    yield self._out(rid, prompt, prompt_ids, [], "", "abort", None, params)
                    return
                if prompt is not None and "CRASH" in prompt and i == 2:
                    self.healthy = False
                    raise RuntimeError("fake engine died")
                tid = ord("a") + i % 26
                reason = None
                if tid in params.stop_token_ids:
                    reason = "stop"
                elif i == max_tokens - 1:
                    reason = "length"
                out_kv = None
                if kv is not None and reason:  # as a prefill instance answers
                    out_kv = KVTransferParams(
                        do_remote_prefill=True,
                        remote_block_ids=[1, 2],
                        remote_request_id=rid,
                        remote_host="127.0.0.1",
                        remote_port=9,
                    )
                if reason:  # the engine's stats drop a request before its last output is sent
                    self.running.discard(rid)
                yield self._out(rid, prompt, prompt_ids, [tid], chr(tid), reason, out_kv, params)
                if reason:
                    return
        finally:
            self.running.discard(rid)
            self._abort_events.pop(rid, None)
            self._sent_prompt_logprobs.discard(rid)

    def _out(
        self,
        rid: str,
        prompt: str | None,
        prompt_ids: list[int],
        ids: list[int],
        text: str,
        reason: str | None,
        kv: KVTransferParams | None,
        params: SamplingParams,
    ) -> RequestOutput:
        logprobs = [-0.5] * len(ids) if params.logprobs is not None else None
        # top-N alternatives: the sampled id at -0.5, then the ids after it at -1.5, -2.5...
        top = None
        if params.logprobs:
            top = [{t + j: -0.5 - j for j in range(params.logprobs)} for t in ids]
        comp = CompletionOutput(
            0, text, ids, logprobs=logprobs, top_logprobs=top, finish_reason=reason
        )
        plp = None
        if params.prompt_logprobs is not None and rid not in self._sent_prompt_logprobs:
            self._sent_prompt_logprobs.add(rid)
            plp = fake_prompt_logprobs(prompt_ids, params.prompt_logprobs)
        return RequestOutput(
            request_id=rid,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            outputs=[comp],
            finished=reason is not None,
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_params=kv,
            prompt_logprobs=plp,
        )

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        event = self._abort_events.get(request_id)
        if event is not None:
            event.set()

    def latest_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=0,
            kv_cache_usage=0.25,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
            num_preemptions=2,
            prompt_tokens_by_source={"local_compute": 60, "local_cache_hit": 40},
            step_paths={"graph": 7, "eager:prefill": 3},
            num_steps=10,
        )

    async def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("fake engine is dead")

    async def shutdown(self) -> None:
        return None


class ServerThread:
    """An app under ``ApiServer`` on 127.0.0.1:<ephemeral> in a daemon thread."""

    def __init__(self, app: Any, shutdown_timeout: float = 5.0) -> None:
        self.app = app
        self.server = ApiServer(
            app, host="127.0.0.1", port=0, shutdown_timeout=shutdown_timeout, log_level="warning"
        )
        self.server.bind()
        self.port = self.server.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as e:  # surfaced by stop()
            self.error = e

    def start(self) -> ServerThread:
        self.thread.start()
        if not self.server.started.wait(10):
            raise RuntimeError(f"server did not start: {self.error!r}")
        return self

    def stop(self, timeout: float = 15.0) -> None:
        if self.thread.is_alive():
            self.server.request_shutdown()
            self.thread.join(timeout)
        assert not self.thread.is_alive(), "server thread did not stop"
        assert self.error is None, repr(self.error)


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient()


ServerFactory = Callable[..., ServerThread]


@pytest.fixture
def make_server() -> Iterator[ServerFactory]:
    """``make_server(engine, shutdown_timeout=..., **build_app_kwargs)`` → running server
    (with the session's P/D secret unless ``pd_secret`` is given)."""
    servers: list[ServerThread] = []

    def factory(
        engine: FakeEngineClient, *, shutdown_timeout: float = 5.0, **kwargs: Any
    ) -> ServerThread:
        kwargs.setdefault("served_model_names", [MODEL])
        kwargs.setdefault("pd_secret", pd_secret())
        srv = ServerThread(build_app(engine, **kwargs), shutdown_timeout=shutdown_timeout)
        servers.append(srv.start())
        return srv

    yield factory
    for srv in servers:
        srv.stop()


@pytest.fixture(scope="module")
def server_engine() -> FakeEngineClient:
    """The engine behind ``server`` (shared by a test module; use unique request ids)."""
    return FakeEngineClient()


@pytest.fixture(scope="module")
def server(server_engine: FakeEngineClient) -> Iterator[ServerThread]:
    """One server per test module, with ``enable_prompt_tokens_details`` and the P/D secret."""
    srv = ServerThread(
        build_app(
            server_engine,
            served_model_names=[MODEL],
            enable_prompt_tokens_details=True,
            pd_secret=pd_secret(),
        )
    ).start()
    yield srv
    srv.stop()
