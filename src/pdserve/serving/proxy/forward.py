"""The two legs of one disaggregated request.

One client request becomes (the flow of vLLM's disaggregated-prefill proxy):

1. a **prefill leg**: the client's body with ``max_tokens=1`` (and
   ``max_completion_tokens=1`` if present), ``stream=false``, without ``stream_options``
   and ``min_tokens``, plus ``kv_transfer_params`` asking for a remote decode; sent to
   the least-loaded healthy prefill instance. A connection error, timeout, 5xx or
   malformed 200 is retried once on another healthy prefill instance; a 4xx is the
   client's fault and is returned as is.
2. a **decode leg**: the client's original body plus the prefill's
   ``kv_transfer_params`` copied verbatim, sent to the least-loaded healthy decode
   instance; its status, headers' content type and body go back to the client, a stream
   chunk by chunk as it arrives (no buffering; the client's reading paces the upstream).

Both legs carry the same ``X-Request-Id``. A 200 prefill answer without
``kv_transfer_params`` is counted and logged (decode will then recompute the prompt).

KV ownership: once the prefill leg returned parameters, the prefill instance holds the
prompt's KV until decode pulls it. If the decode leg does not end normally (client
disconnect, no decode instance, connection error or timeout, error status), the proxy
asks the prefill instance to release it: ``POST {prefill}/v1/kv_transfer/release``
``{"request_id": <id>}``, fire-and-forget on a tracked background task (a 404 from
servers without the endpoint is ignored). A release after decode already pulled the KV
is a no-op on a correct server, so the rule errs on the side of releasing.

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
        if core.decode.num_healthy == 0:  # fail fast: don't spend prefill work for nothing
            await self._reply(self._unavailable(core.decode))
            return
        pre = await self._prefill_leg()
        if isinstance(pre, Reply):
            await self._reply(pre)
            return
        if pre.kv_params is not None:
            self._held = pre.instance.url
        await self._decode_leg(pre.kv_params)

    # -- prefill ------------------------------------------------------------------
    async def _prefill_leg(self) -> _PrefillDone | Reply:
        pool = self.core.prefill
        body = prefill_body(self.client_body)
        tried: list[str] = []
        failure: Reply | None = None
        for attempt in range(2):
            inst = pool.pick(exclude=tried)
            if inst is None:
                break
            if attempt:
                self.core.metrics.retried("prefill")
                logger.warning(
                    "request %s: retrying the prefill leg on %s after failure on %s",
                    self.request_id,
                    inst.url,
                    tried[-1],
                )
            tried.append(inst.url)
            result = await self._prefill_once(inst, body)
            if isinstance(result, _PrefillDone):
                return result
            if 400 <= result.status < 500:
                return result  # the client's fault: as is, no retry
            failure = result
        if failure is None:
            return self._unavailable(pool)
        return failure

    async def _prefill_once(self, inst: Instance, body: dict[str, Any]) -> _PrefillDone | Reply:
        """One attempt; a :class:`Reply` is the answer to give if it is the last."""
        core, url = self.core, inst.url
        t0 = time.perf_counter()
        with core.prefill.lease(inst):
            try:
                async with core.session.post(
                    url + self.path,
                    json=body,
                    headers=self.upstream_headers,
                    timeout=core.leg_timeout(streaming=False),
                ) as resp:
                    data = await resp.read()
                    status = resp.status
                    ctype = resp.headers.get("Content-Type", "application/json")
            except asyncio.CancelledError:
                core.metrics.leg_done("prefill", url, "client_disconnect")
                raise
            except Exception as e:
                outcome, unreachable = classify_error(e)
                core.metrics.leg_done("prefill", url, outcome)
                if unreachable:
                    core.prefill.set_healthy(inst, False, f"{type(e).__name__}: {e}")
                logger.warning("request %s: prefill leg on %s failed: %r", self.request_id, url, e)
                code = 504 if outcome == "timeout" else 502
                return Reply.error(code, f"prefill leg failed on {url}: {outcome}")
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
        core = self.core
        inst = core.decode.pick()
        if inst is None:
            self._release("no_decode_instance")
            await self._reply(self._unavailable(core.decode))
            return
        url = inst.url
        with core.decode.lease(inst):
            try:
                resp = await core.session.post(
                    url + self.path,
                    json=decode_body(self.client_body, kv_params),
                    headers=self.upstream_headers,
                    timeout=core.leg_timeout(streaming=self.streaming),
                )
            except asyncio.CancelledError:
                self._decode_outcome(url, "client_disconnect")
                raise
            except Exception as e:
                outcome, unreachable = classify_error(e)
                self._decode_outcome(url, outcome)
                if unreachable:
                    core.decode.set_healthy(inst, False, f"{type(e).__name__}: {e}")
                logger.warning("request %s: decode leg on %s failed: %r", self.request_id, url, e)
                self._release("decode_connection_error")
                code = 504 if outcome == "timeout" else 502
                await self._reply(Reply.error(code, f"decode leg failed on {url}: {outcome}"))
                return
            clean = False
            try:
                if resp.status == 200 and self.streaming:
                    clean = await self._stream(inst, resp)
                else:
                    clean = await self._decode_whole(inst, resp)
            except (asyncio.CancelledError, _ClientGone):
                self._decode_outcome(url, "client_disconnect")
                raise
            finally:
                if clean:
                    resp.release()  # fully read: the connection can be reused
                else:
                    resp.close()  # abort the upstream request

    async def _decode_whole(self, inst: Instance, resp: aiohttp.ClientResponse) -> bool:
        """Read the whole answer and pass it on; ``False`` if the upstream broke."""
        core, url = self.core, inst.url
        try:
            data = await resp.read()
        except Exception as e:
            outcome, unreachable = classify_error(e)
            self._decode_outcome(url, outcome)
            if unreachable:
                core.decode.set_healthy(inst, False, f"{type(e).__name__}: {e}")
            self._release("decode_connection_error")
            code = 504 if outcome == "timeout" else 502
            await self._reply(Reply.error(code, f"decode leg failed on {url}: {outcome}"))
            return False
        self._decode_outcome(url, status_outcome(resp.status))
        if resp.status == 200:
            self._held = None
            core.metrics.observe_ttft(url, time.perf_counter() - self.arrival)
        else:
            logger.warning(
                "request %s: decode leg on %s answered %d", self.request_id, url, resp.status
            )
            self._release("decode_error")
        ctype = resp.headers.get("Content-Type", "application/json")
        await self._reply(Reply(resp.status, data, ctype))
        return True

    async def _stream(self, inst: Instance, resp: aiohttp.ClientResponse) -> bool:
        """Pass the SSE stream through; ``False`` if the upstream broke mid-stream (the
        client then gets an error event if the break fell between events, and the end
        of the response without ``[DONE]``)."""
        core, url = self.core, inst.url
        ctype = resp.headers.get("Content-Type", "text/event-stream")
        await self._start(200, ctype, extra=[(b"cache-control", b"no-cache")])
        meter = SSEMeter()
        try:
            async for chunk in resp.content.iter_any():
                had_first = meter.first is not None
                meter.feed(chunk, time.perf_counter())
                if not had_first and meter.first is not None:
                    core.metrics.observe_ttft(url, meter.first - self.arrival)
                await self._body(chunk, more=True)
        except (asyncio.CancelledError, _ClientGone):
            raise
        except Exception as e:
            outcome, unreachable = classify_error(e)
            self._decode_outcome(url, outcome)
            if unreachable:
                core.decode.set_healthy(inst, False, f"{type(e).__name__}: {e}")
            logger.warning("request %s: decode stream from %s broke: %r", self.request_id, url, e)
            self._release("decode_connection_error")
            tail = b""
            if meter.at_event_boundary:
                tail = sse_error(502, f"decode stream from {url} broke: {outcome}").encode()
            await self._body(tail, more=False)
            return False
        self._held = None
        self._decode_outcome(url, "success")
        tpot = meter.tpot()
        if tpot is not None:
            core.metrics.observe_tpot(url, tpot)
        await self._body(b"", more=False)
        return True

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
