"""The legs of one proxied request: two for a disaggregated request, one for a
colocated request.

One client request to a P/D proxy becomes (the flow of vLLM's disaggregated-prefill
proxy):

1. a **prefill leg**: the client's body with ``max_tokens=1`` (and
   ``max_completion_tokens=1`` if present), ``stream=false``, without ``stream_options``,
   ``min_tokens``, ``n`` and ``best_of`` (one sample), plus signed ``kv_transfer_params`` asking for a remote decode;
   sent to the least-loaded healthy prefill instance. A connection error, timeout, 5xx,
   malformed 200 or the instance being marked down is retried once on another healthy
   prefill instance; a 4xx is the client's fault and is returned as is.
2. a **decode leg**: the client's original body (its ``n`` too: the decode instance
   draws the samples, sharing the pulled prompt KV) plus the prefill's
   ``kv_transfer_params``, re-signed by the proxy, sent to the least-loaded healthy
   decode instance; its status, headers' content type and body go back to the client, a
   stream chunk by chunk as it arrives (no buffering; the client's reading paces the
   upstream). A stream's status line waits for its first chunk, so a decode that fails
   before it can still be replaced (below).

Both legs carry the same ``X-Request-Id``; every attempt's ``kv_transfer_params`` are
signed afresh for it (single use, :mod:`pdserve.core_types.pd_auth`). A 200 prefill
answer without ``kv_transfer_params`` is counted and logged (decode will then recompute
the prompt).

Choosing an instance: a connection that could not be established (refused,
unreachable, connect timeout) means the request never reached the instance, so it does
not use up the leg's attempt: the leg goes to another instance of the pool. When a pool
has no eligible instance (none healthy, or the only ones refused this request), the
request waits for one to come (back) up, for at most ``queue_timeout`` seconds (e.g.
while the launcher restarts a pool's one instance), then gets 503 (or the last
connection error, 502); a decode leg does not wait (see below). Before the prefill leg
the decode pool must have a healthy instance too (waiting the same way), so no prefill
work is spent for nothing.

Deadlines follow health: each leg runs under its instance's guard
(:meth:`pdserve.serving.proxy.pool.InstancePool.guard`). When the instance is marked
down (probes time out: it hangs; or connections fail: it died), the leg is failed at
once with outcome ``instance_down``: a prefill leg is retried on another instance.

A decode instance that dies under a request: a decode leg is never re-sent with the
same prompt KV (the instance may have pulled it already; prefill serves a lease to one
decode). When the leg fails after it may have reached the instance (the connection
dropped, also when a new connection is then refused:
:class:`~pdserve.serving.proxy.upstream.ConnectionLost`; the instance was marked down;
or it answered 503, e.g. its prompt's KV was lost) and nothing went to the client yet,
the KV is released at once and the whole request runs once more, **re-prefilled**, on
another decode instance (or the same one once it came back: a new generation), waiting
for one as a new request does (``queue_timeout``); if none comes, 503 naming the
failure. A decode leg whose connection was never established goes to another healthy
decode instance with the same (never used) params; when none is eligible right now the
KV is released and the request waits and runs again the same way: held KV never waits
for an instance (so nothing waits on a lease that may be gone). A failure after the
first chunk ends the stream with an error event (503 when the instance went away).

KV ownership: once the prefill leg returned parameters, the prefill instance holds the
prompt's KV until decode pulls it. If the decode leg does not end normally (client
disconnect, no decode instance, connection error or timeout, instance marked down, error
status), the proxy asks the prefill instance to release it: ``POST
{prefill}/v1/kv_transfer/release`` ``{"request_id": <id>}``, fire-and-forget on a
tracked background task (a 404 from servers without the endpoint is ignored). A release
after decode already pulled the KV is a no-op on a correct server, so the rule errs on
the side of releasing.

Colocated instances (a proxy built with colocated URLs): the request goes whole (the
client's body without any ``kv_transfer_params``) to the least-loaded healthy
colocated instance, and its answer goes back as the decode leg's does, under the same
guard, lease, health accounting and connection rule. As no KV is pulled, a request that
failed on an instance before any byte went to the client (connection error, timeout,
instance marked down, 5xx, or a stream that broke before its first chunk; a stream's
status line is held back until its first chunk for this) is retried once on another
healthy instance, like a prefill leg; a 4xx is returned as is.

Client disconnect: :class:`ProxyResponse` watches the ASGI ``receive`` channel while
the legs run; on ``http.disconnect`` it cancels them, which closes the upstream
connection so the upstream server aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdserve.serving.http import REQUEST_ID_HEADER, sse_error, wait_for_disconnect
from pdserve.serving.proxy.core import (
    ProxyCore,
    Reply,
    classify_error,
    decode_body,
    not_sent,
    prefill_body,
    status_outcome,
)
from pdserve.serving.proxy.pool import Instance, InstancePool
from pdserve.serving.proxy.sse_meter import SSEMeter

logger = logging.getLogger(__name__)


@dataclass
class _PrefillDone:
    instance: Instance
    kv_params: dict[str, Any] | None


@dataclass
class _NotSent:
    """An attempt whose connection was never established; ``reply`` if it is the last."""

    reply: Reply


@dataclass
class _Failed:
    """An attempt that failed after it may have reached its instance, with nothing sent
    to the client yet, so another instance may take the leg; ``reply`` if it is the last."""

    reply: Reply


@dataclass
class _Redo:
    """A decode leg that failed with nothing sent to the client (its instance went away
    under it, answered 503, or none could take it) and its KV released: the request may
    run again from its prefill leg on another decode instance; ``reply`` if it cannot."""

    reply: Reply


_T = TypeVar("_T")


class _ClientGone(Exception):
    """The client went away while the legs ran."""


class ProxyResponse(Response):
    """Runs the legs when Starlette sends this response; see the module docstring.

    Built by the route handler after auth and body checks; everything else, including
    the status code, is decided while :meth:`__call__` runs.
    """

    def __init__(
        self,
        core: ProxyCore,
        path: str,
        body: dict[str, Any],
        *,
        request_id: str,
        authorization: str | None,
        arrival: float,
    ) -> None:
        super().__init__(status_code=200)
        self.core = core
        self.path = path
        self.client_body = body
        self.request_id = request_id
        self.upstream_headers = core.upstream_headers(request_id, authorization)
        self.arrival = arrival
        self.streaming = body.get("stream") is True
        self._send: Send | None = None
        self._held: str | None = None  # prefill URL holding this request's KV
        self._decode_counted = False  # an answer attempt's outcome is counted once
        self._response_started = False  # the status line went to the client
        self._meter: SSEMeter | None = None  # the answer stream's, once it started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        work = asyncio.ensure_future(self._run())
        gone = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # client gone, or the server cancelled us
            with contextlib.suppress(asyncio.CancelledError):
                await work
            with contextlib.suppress(asyncio.CancelledError):
                await gone

    async def _run(self) -> None:
        try:
            await self._legs()
        except _ClientGone:
            logger.info("request %s: client disconnected", self.request_id)
            self._release("client_disconnect")
        except asyncio.CancelledError:
            logger.info("request %s: client disconnected", self.request_id)
            self._release("client_disconnect")
            raise
        except Exception:  # a bug: free the KV, let the server log it and answer 500
            self._release("proxy_error")
            raise

    async def _legs(self) -> None:
        core = self.core
        if core.prefill is None:  # colocated: the whole request to one instance
            await self._answer_leg(None)
            return
        if core.decode.num_healthy == 0 and not await self._wait_healthy(core.decode):
            await self._reply(self._unavailable(core.decode))  # no prefill work for nothing
            return
        tried: dict[str, int] = {}  # decode instances tried (URL -> generation)
        answer: Reply | None = None  # the last decode failure's, if no decode takes it
        for again in (False, True):  # once more, re-prefilled, after a decode failed
            if again:  # a decode instance other than the ones that failed, or 503
                deadline = asyncio.get_running_loop().time() + core.settings.queue_timeout
                if await core.decode.wait_pick(tried, deadline) is None:
                    break
                core.metrics.retried("decode")
                logger.warning(
                    "request %s: decode failed on %s; prefilling it again for another "
                    "decode instance",
                    self.request_id,
                    ", ".join(tried),
                )
            pre = await self._attempts(core.prefill, self._prefill_once, tries=2)
            if isinstance(pre, Reply):
                await self._reply(pre)
                return
            if pre.kv_params is not None:
                self._held = pre.instance.url
            redo = await self._answer_leg(pre.kv_params, tried)
            if redo is None:
                return
            answer = redo.reply
        assert answer is not None
        await self._reply(answer)

    async def _wait_healthy(self, pool: InstancePool) -> bool:
        deadline = asyncio.get_running_loop().time() + self.core.settings.queue_timeout
        return await pool.wait_healthy(deadline)

    async def _attempts(
        self,
        pool: InstancePool,
        once: Callable[[Instance], Awaitable[_T | Reply | _Failed | _NotSent]],
        *,
        tries: int,
        tried: dict[str, int] | None = None,
        wait: bool = True,
    ) -> _T | Reply:
        """Send one leg to ``pool`` with ``once(instance)``: at most ``tries`` attempts
        that reached an instance (after a :class:`_Failed` one the leg goes to another
        healthy instance if one is there now, else that failure is the answer); an
        attempt whose connection was never established (:class:`_NotSent`) does not
        count (before any failure, the next one waits for an eligible instance up to
        ``queue_timeout``, unless not ``wait``; see the module docstring). ``tried``:
        instances (URL -> generation) not to use unless they came back; the instances
        this call tries are added to it. Returns what
        ``once`` returned otherwise (a success, or a :class:`Reply` to give as is), or the
        last failure's reply (503 if no instance was eligible)."""
        deadline = asyncio.get_running_loop().time() + self.core.settings.queue_timeout
        tried = {} if tried is None else tried  # URL -> generation when tried
        last = ""  # the URL of this call's last attempt
        failure: Reply | None = None  # the answer if no attempt succeeds
        failed = 0
        while failed < tries:
            if failed == 0 and wait:
                inst = await pool.wait_pick(tried, deadline)
            else:
                inst = pool.pick(pool.not_back(tried))
            if inst is None:
                break
            if last:
                self.core.metrics.retried(pool.role)
                logger.warning(
                    "request %s: retrying the %s leg on %s after failure on %s",
                    self.request_id,
                    pool.role,
                    inst.url,
                    last,
                )
            tried[inst.url], last = inst.generation, inst.url
            result = await once(inst)
            if isinstance(result, _NotSent):
                failure = result.reply
            elif isinstance(result, _Failed):
                failure = result.reply
                failed += 1
            else:
                return result
        return failure if failure is not None else self._unavailable(pool)

    # -- prefill ------------------------------------------------------------------
    async def _prefill_once(self, inst: Instance) -> _PrefillDone | Reply | _Failed | _NotSent:
        """One attempt; a 4xx :class:`Reply` is the client's fault (as is, no retry)."""
        core, url = self.core, inst.url
        assert core.prefill is not None  # a P/D proxy's
        t0 = time.perf_counter()
        with core.prefill.lease(inst):
            try:
                async with core.prefill.guard(inst):
                    resp = await core.upstream.request(
                        "POST",
                        url + self.path,
                        instance=url,
                        json_factory=lambda: prefill_body(
                            self.client_body, core.secret, self.request_id, self.path
                        ),
                        headers=self.upstream_headers,
                        timeout=core.leg_timeout(streaming=False),
                    )
                    async with resp:
                        data = await resp.read()
                        status = resp.status
                        ctype = resp.headers.get("Content-Type", "application/json")
            except asyncio.CancelledError:
                core.metrics.leg_done("prefill", url, "client_disconnect")
                raise
            except Exception as e:
                outcome = self._leg_error(core.prefill, inst, e)
                code = 504 if outcome == "timeout" else 502
                reply = Reply.error(code, f"prefill leg failed on {url}: {outcome}")
                return _NotSent(reply) if not_sent(e) else _Failed(reply)
        core.prefill.record_success(inst)
        if status != 200:
            outcome = status_outcome(status) if status >= 400 else "bad_response"
            core.metrics.leg_done("prefill", url, outcome)
            logger.warning(
                "request %s: prefill leg on %s answered %d", self.request_id, url, status
            )
            if status < 400:
                return _Failed(Reply.error(502, f"prefill leg on {url} answered {status}"))
            if status < 500:
                return Reply(status, data, ctype)  # the client's fault: as is, no retry
            return _Failed(Reply(status, data, ctype))
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            core.metrics.leg_done("prefill", url, "bad_response")
            logger.warning("request %s: prefill on %s sent no JSON object", self.request_id, url)
            return _Failed(Reply.error(502, f"prefill leg on {url} answered with no JSON object"))
        core.metrics.leg_done("prefill", url, "success")
        core.metrics.observe_prefill_leg(url, time.perf_counter() - t0)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            core.metrics.missing_kv_params(url)
            logger.warning(
                "request %s: prefill instance %s returned no kv_transfer_params "
                "(finish_reason=%s); decode will recompute the whole prompt",
                self.request_id,
                url,
                _finish_reason(answer),
            )
            params = None
        return _PrefillDone(inst, params)

    # -- the answer: decode, or colocated ------------------------------------------
    async def _answer_leg(
        self, kv_params: dict[str, Any] | None, tried: dict[str, int] | None = None
    ) -> _Redo | None:
        """The leg whose answer goes to the client: the decode leg (with the prefill's
        ``kv_params``), or a colocated request (``None``; retried once, see the module
        docstring). A decode leg does not wait for an instance holding KV (``tried``:
        instances not to use, updated with those it tries) and returns :class:`_Redo`
        when it fails before the client got a byte."""
        pool = self.core.answer
        colocated = self.core.colocated
        tries = 2 if colocated else 1

        async def once(inst: Instance) -> _Failed | _NotSent | _Redo | None:
            return await self._answer_once(inst, kv_params)

        result = await self._attempts(pool, once, tries=tries, tried=tried, wait=colocated)
        if isinstance(result, Reply):
            self._release("no_decode_instance")
            if colocated:
                await self._reply(result)
                return None
            return _Redo(result)
        return result

    async def _answer_once(
        self, inst: Instance, kv_params: dict[str, Any] | None
    ) -> _Failed | _NotSent | _Redo | None:
        """One attempt: ``None`` once the client has its answer, else the error to give
        if no other instance takes the request (:class:`_NotSent`: its connection was
        never established; :class:`_Failed`: a colocated request that failed before any
        byte went to the client; :class:`_Redo`: a decode leg that failed so, its KV
        released)."""
        core, pool, url = self.core, self.core.answer, inst.url
        retry = core.colocated  # nothing was pulled: another instance may take it
        self._decode_counted = False
        resp: aiohttp.ClientResponse | None = None
        clean = False
        reply: Reply | None = None  # a whole answer, sent once the leg is over
        with pool.lease(inst):
            try:
                async with pool.guard(inst):
                    resp = await core.upstream.request(
                        "POST",
                        url + self.path,
                        instance=url,
                        json_factory=lambda: decode_body(
                            self.client_body, kv_params, core.secret, self.request_id
                        ),
                        headers=self.upstream_headers,
                        timeout=core.leg_timeout(streaming=self.streaming),
                    )
                    pool.record_success(inst)
                    if resp.status == 200 and self.streaming:
                        await self._stream(url, resp)
                    else:
                        reply = await self._whole(url, resp)
                    clean = True
            except (asyncio.CancelledError, _ClientGone):
                self._decode_outcome(url, "client_disconnect")
                raise
            except Exception as e:
                if resp is None and not_sent(e):
                    outcome = self._leg_error(pool, inst, e, count=False)
                    core.metrics.leg_done(pool.role, url, outcome)
                    code = 502 if retry else 503  # held KV does not wait for an instance
                    return _NotSent(
                        Reply.error(code, f"{pool.role} leg failed on {url}: {outcome}")
                    )
                return await self._answer_failed(inst, e, retry=retry)
            finally:
                if resp is not None:
                    if clean:
                        resp.release()  # fully read: the connection can be reused
                    else:
                        resp.close()  # abort the upstream request
        if reply is not None:
            if retry and reply.status >= 500:
                return _Failed(reply)
            if reply.status == 503 and not retry:  # e.g. its prompt's KV was lost
                return _Redo(reply)
            await self._reply(reply)
        return None

    async def _whole(self, url: str, resp: aiohttp.ClientResponse) -> Reply:
        """Read the whole answer: the reply to pass on."""
        data = await resp.read()
        self._decode_outcome(url, status_outcome(resp.status))
        if resp.status == 200:
            self._held = None
            self.core.metrics.observe_ttft(url, time.perf_counter() - self.arrival)
        else:
            logger.warning(
                "request %s: %s leg on %s answered %d",
                self.request_id,
                self.core.answer.role,
                url,
                resp.status,
            )
            self._release("decode_error")
        ctype = resp.headers.get("Content-Type", "application/json")
        return Reply(resp.status, data, ctype)

    async def _stream(self, url: str, resp: aiohttp.ClientResponse) -> None:
        """Pass the SSE stream through (a break is handled by :meth:`_answer_failed`).
        The status line waits for the first chunk, so a stream that breaks before it can
        still be retried or redone."""
        core = self.core
        ctype = resp.headers.get("Content-Type", "text/event-stream")
        extra = [(b"cache-control", b"no-cache")]
        meter = self._meter = SSEMeter()
        async for chunk in resp.content.iter_any():
            had_first = meter.first is not None
            meter.feed(chunk, time.perf_counter())
            if not had_first and meter.first is not None:
                core.metrics.observe_ttft(url, meter.first - self.arrival)
            if not self._response_started:
                await self._start(200, ctype, extra=extra)
            await self._body(chunk, more=True)
        if not self._response_started:
            await self._start(200, ctype, extra=extra)
        self._held = None
        self._decode_outcome(url, "success")
        tpot = meter.tpot()
        if tpot is not None:
            core.metrics.observe_tpot(url, tpot)
        await self._body(b"", more=False)

    async def _answer_failed(
        self, inst: Instance, exc: Exception, *, retry: bool
    ) -> _Failed | _Redo | None:
        """The answer leg broke after it may have reached the instance: count it; with
        ``retry`` and nothing sent to the client yet, return the error for another
        attempt; else free the KV and, for a decode instance that went away before
        anything reached the client, return :class:`_Redo` (503 if nothing takes it);
        else tell the client (a 502/504, or mid-stream: an error event if the break fell
        between events, then the end of the response without ``[DONE]``)."""
        url, pool = inst.url, self.core.answer
        outcome = self._leg_error(pool, inst, exc, count=False)
        self._decode_outcome(url, outcome)
        gone = outcome in ("connection_error", "instance_down")  # it died, or hangs
        code = 504 if outcome == "timeout" else 503 if gone else 502
        failure = Reply.error(code, f"{pool.role} leg failed on {url}: {outcome}")
        if retry and not self._response_started:
            return _Failed(failure)
        down = outcome == "instance_down"
        self._release("decode_instance_down" if down else "decode_connection_error")
        if self._response_started:
            meter = self._meter
            tail = b""
            if meter is None or meter.at_event_boundary:
                tail = sse_error(code, f"{pool.role} stream from {url} broke: {outcome}").encode()
            await self._body(tail, more=False)
            return None
        if gone:
            why = (
                f"decode instance {url} failed under this request ({outcome}) and no other "
                "decode instance took it; retry later"
            )
            return _Redo(Reply.error(503, why))
        await self._reply(failure)
        return None

    def _leg_error(
        self, pool: InstancePool, inst: Instance, exc: Exception, *, count: bool = True
    ) -> str:
        """Classify a leg's exception, log it, count a failure of an unreachable instance;
        with ``count``, also the leg's outcome. Returns the outcome."""
        outcome, unreachable = classify_error(exc)
        if count:
            self.core.metrics.leg_done(pool.role, inst.url, outcome)
        if unreachable:
            pool.record_failure(inst, f"{type(exc).__name__}: {exc}")
        logger.warning(
            "request %s: %s leg on %s failed: %r", self.request_id, pool.role, inst.url, exc
        )
        return outcome

    # -- helpers ------------------------------------------------------------------
    def _decode_outcome(self, url: str, outcome: str) -> None:
        """Count the answer attempt's outcome (once)."""
        if not self._decode_counted:
            self._decode_counted = True
            self.core.metrics.leg_done(self.core.answer.role, url, outcome)

    def _release(self, reason: str) -> None:
        url, self._held = self._held, None
        if url is None:
            return
        logger.info("request %s: releasing its KV on %s (%s)", self.request_id, url, reason)
        self.core.metrics.kv_released(url, reason)
        self.core.spawn(self.core.release_kv(url, self.request_id, self.upstream_headers))

    def _unavailable(self, pool: InstancePool) -> Reply:
        self.core.metrics.unavailable(pool.role)
        return Reply.error(
            503, f"no healthy {pool.role} instance (0 of {len(pool)} healthy); retry later"
        )

    async def _reply(self, reply: Reply) -> None:
        await self._start(reply.status, reply.content_type, length=len(reply.body))
        await self._body(reply.body, more=False)

    async def _start(
        self,
        status: int,
        content_type: str,
        *,
        length: int | None = None,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        headers = [
            (b"content-type", content_type.encode("latin-1")),
            (REQUEST_ID_HEADER.encode(), self.request_id.encode("latin-1")),
        ]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        headers.extend(extra or [])
        self._response_started = True
        await self._emit({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, data: bytes, *, more: bool) -> None:
        await self._emit({"type": "http.response.body", "body": data, "more_body": more})

    async def _emit(self, message: Any) -> None:
        assert self._send is not None  # set by __call__ before anything runs
        try:
            await self._send(message)
        except OSError as e:  # ASGI servers may raise this once the client is gone
            raise _ClientGone() from e


def _finish_reason(answer: dict[str, Any]) -> str | None:
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        return str(reason) if reason is not None else None
    return None
