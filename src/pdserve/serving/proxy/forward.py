"""The two legs of one disaggregated request.

One client request becomes (the flow of vLLM's disaggregated-prefill proxy):

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
   upstream).

Both legs carry the same ``X-Request-Id``. A 200 prefill answer without
``kv_transfer_params`` is counted and logged (decode will then recompute the prompt).

Choosing an instance: a connection that could not be established (refused,
unreachable, connect timeout) means the request never reached the instance, so it does
not use up the leg's attempt: the leg goes to another instance of the pool. When a pool
has no eligible instance (none healthy, or the only ones refused this request), the
request waits for one to come (back) up, for at most ``queue_timeout`` seconds (e.g.
while the launcher restarts a pool's one instance), then gets 503 (or the last
connection error, 502). Before the prefill leg the decode pool must have a healthy
instance too (waiting the same way), so no prefill work is spent for nothing.

Deadlines follow health: each leg runs under its instance's guard
(:meth:`pdserve.serving.proxy.pool.InstancePool.guard`). When the instance is marked
down (probes time out: it hangs; or connections fail: it died), the leg is failed at
once with outcome ``instance_down``: a prefill leg is retried on another instance; a
decode leg is answered 502 (or, mid-stream, ends with an error event). A decode leg is
not re-sent to another instance: the instance that was marked down may already be
pulling the prompt's KV, and a second pull would race it.

KV ownership: once the prefill leg returned parameters, the prefill instance holds the
prompt's KV until decode pulls it. If the decode leg does not end normally (client
disconnect, no decode instance, connection error or timeout, instance marked down, error
status), the proxy asks the prefill instance to release it: ``POST
{prefill}/v1/kv_transfer/release`` ``{"request_id": <id>}``, fire-and-forget on a
tracked background task (a 404 from servers without the endpoint is ignored). A release
after decode already pulled the KV is a no-op on a correct server, so the rule errs on
the side of releasing.

Client disconnect: :class:`PDResponse` watches the ASGI ``receive`` channel while the
legs run; on ``http.disconnect`` it cancels them, which closes the upstream connection
so the upstream server aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

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


class _ClientGone(Exception):
    """The client went away while the legs ran."""


class PDResponse(Response):
    """Runs both legs when Starlette sends this response; see the module docstring.

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
        self._decode_counted = False  # the decode leg's outcome is counted once
        self._response_started = False  # the status line went to the client
        self._meter: SSEMeter | None = None  # the decode stream's, once it started

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
            await self._both_legs()
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

    async def _both_legs(self) -> None:
        core = self.core
        if core.decode.num_healthy == 0 and not await self._wait_healthy(core.decode):
            await self._reply(self._unavailable(core.decode))  # no prefill work for nothing
            return
        pre = await self._prefill_leg()
        if isinstance(pre, Reply):
            await self._reply(pre)
            return
        if pre.kv_params is not None:
            self._held = pre.instance.url
        await self._decode_leg(pre.kv_params)

    async def _wait_healthy(self, pool: InstancePool) -> bool:
        deadline = asyncio.get_running_loop().time() + self.core.settings.queue_timeout
        return await pool.wait_healthy(deadline)

    # -- prefill ------------------------------------------------------------------
    async def _prefill_leg(self) -> _PrefillDone | Reply:
        """Up to two attempts that reached an instance (see the module docstring)."""
        pool = self.core.prefill
        deadline = asyncio.get_running_loop().time() + self.core.settings.queue_timeout
        tried: dict[str, int] = {}  # URL -> generation when tried
        failure: Reply | None = None  # the answer if no attempt succeeds
        attempts = 0
        while attempts < 2:
            if attempts == 0:
                inst = await pool.wait_pick(tried, deadline)
            else:
                inst = pool.pick(u for u, g in tried.items() if pool.get(u).generation == g)
            if inst is None:
                break
            if tried:
                self.core.metrics.retried("prefill")
                logger.warning(
                    "request %s: retrying the prefill leg on %s after failure on %s",
                    self.request_id,
                    inst.url,
                    next(reversed(tried)),
                )
            tried[inst.url] = inst.generation
            result = await self._prefill_once(inst)
            if isinstance(result, _PrefillDone):
                return result
            if isinstance(result, _NotSent):
                failure = result.reply
                continue
            if 400 <= result.status < 500:
                return result  # the client's fault: as is, no retry
            failure = result
            attempts += 1
        return failure if failure is not None else self._unavailable(pool)

    async def _prefill_once(
        self,
        inst: Instance,
    ) -> _PrefillDone | Reply | _NotSent:
        """One attempt; a :class:`Reply` is the answer to give if it is the last."""
        core, url = self.core, inst.url
        t0 = time.perf_counter()
        with core.prefill.lease(inst):
            try:
                async with core.prefill.guard(inst):
                    resp = await core.upstream.request(
                        "POST",
                        url + self.path,
                        instance=url,
                        json=prefill_body(self.client_body, core.secret),
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
                return _NotSent(reply) if not_sent(e) else reply
        core.prefill.record_success(inst)
        if status != 200:
            outcome = status_outcome(status) if status >= 400 else "bad_response"
            core.metrics.leg_done("prefill", url, outcome)
            logger.warning(
                "request %s: prefill leg on %s answered %d", self.request_id, url, status
            )
            if status < 400:
                return Reply.error(502, f"prefill leg on {url} answered {status}")
            return Reply(status, data, ctype)
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            core.metrics.leg_done("prefill", url, "bad_response")
            logger.warning("request %s: prefill on %s sent no JSON object", self.request_id, url)
            return Reply.error(502, f"prefill leg on {url} answered with no JSON object")
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

    # -- decode -------------------------------------------------------------------
    async def _decode_leg(self, kv_params: dict[str, Any] | None) -> None:
        pool = self.core.decode
        deadline = asyncio.get_running_loop().time() + self.core.settings.queue_timeout
        tried: dict[str, int] = {}
        last: Reply | None = None  # the last connection that could not be established
        while (inst := await pool.wait_pick(tried, deadline)) is not None:
            tried[inst.url] = inst.generation
            last = await self._decode_once(inst, kv_params)
            if last is None:
                return
        self._release("no_decode_instance")
        await self._reply(last if last is not None else self._unavailable(pool))

    async def _decode_once(self, inst: Instance, kv_params: dict[str, Any] | None) -> Reply | None:
        """One attempt: ``None`` once the client has its answer, else the error to give
        if no other instance takes the request (its connection was never established)."""
        core, pool, url = self.core, self.core.decode, inst.url
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
                        json=decode_body(self.client_body, kv_params, core.secret),
                        headers=self.upstream_headers,
                        timeout=core.leg_timeout(streaming=self.streaming),
                    )
                    pool.record_success(inst)
                    if resp.status == 200 and self.streaming:
                        await self._stream(url, resp)
                    else:
                        reply = await self._decode_whole(url, resp)
                    clean = True
            except (asyncio.CancelledError, _ClientGone):
                self._decode_outcome(url, "client_disconnect")
                raise
            except Exception as e:
                if resp is None and not_sent(e):
                    outcome = self._leg_error(pool, inst, e, count=False)
                    core.metrics.leg_done("decode", url, outcome)
                    return Reply.error(502, f"decode leg failed on {url}: {outcome}")
                await self._decode_failed(inst, e)
            finally:
                if resp is not None:
                    if clean:
                        resp.release()  # fully read: the connection can be reused
                    else:
                        resp.close()  # abort the upstream request
        if reply is not None:
            await self._reply(reply)
        return None

    async def _decode_whole(self, url: str, resp: aiohttp.ClientResponse) -> Reply:
        """Read the whole answer: the reply to pass on."""
        data = await resp.read()
        self._decode_outcome(url, status_outcome(resp.status))
        if resp.status == 200:
            self._held = None
            self.core.metrics.observe_ttft(url, time.perf_counter() - self.arrival)
        else:
            logger.warning(
                "request %s: decode leg on %s answered %d", self.request_id, url, resp.status
            )
            self._release("decode_error")
        ctype = resp.headers.get("Content-Type", "application/json")
        return Reply(resp.status, data, ctype)

    async def _stream(self, url: str, resp: aiohttp.ClientResponse) -> None:
        """Pass the SSE stream through (a break is handled by :meth:`_decode_failed`)."""
        core = self.core
        ctype = resp.headers.get("Content-Type", "text/event-stream")
        await self._start(200, ctype, extra=[(b"cache-control", b"no-cache")])
        meter = self._meter = SSEMeter()
        async for chunk in resp.content.iter_any():
            had_first = meter.first is not None
            meter.feed(chunk, time.perf_counter())
            if not had_first and meter.first is not None:
                core.metrics.observe_ttft(url, meter.first - self.arrival)
            await self._body(chunk, more=True)
        self._held = None
        self._decode_outcome(url, "success")
        tpot = meter.tpot()
        if tpot is not None:
            core.metrics.observe_tpot(url, tpot)
        await self._body(b"", more=False)

    async def _decode_failed(self, inst: Instance, exc: Exception) -> None:
        """The decode leg broke after it may have reached the instance: count it, free
        the KV, and tell the client (a 502/504, or mid-stream: an error event if the
        break fell between events, then the end of the response without ``[DONE]``)."""
        url = inst.url
        outcome = self._leg_error(self.core.decode, inst, exc, count=False)
        self._decode_outcome(url, outcome)
        down = outcome == "instance_down"
        self._release("decode_instance_down" if down else "decode_connection_error")
        if self._response_started:
            meter = self._meter
            tail = b""
            if meter is None or meter.at_event_boundary:
                tail = sse_error(502, f"decode stream from {url} broke: {outcome}").encode()
            await self._body(tail, more=False)
            return
        code = 504 if outcome == "timeout" else 502
        await self._reply(Reply.error(code, f"decode leg failed on {url}: {outcome}"))

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
        if not self._decode_counted:
            self._decode_counted = True
            self.core.metrics.leg_done("decode", url, outcome)

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
