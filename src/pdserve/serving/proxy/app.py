"""The app of ``pdserve proxy``: the OpenAI-compatible router of a disaggregated (xPyD)
deployment, or the load balancer of colocated instances.

A proxy has either a prefill and a decode pool (P/D) or one ``colocated`` pool; a mix
is refused (which pool would take a request is no question worth a rule: run one proxy
per deployment). Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``
and ``POST /v1/responses`` (two legs each in P/D, one whole request in colocated mode,
see :mod:`pdserve.serving.proxy.forward`), ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /tokenize`` and ``POST /detokenize`` (forwarded to a healthy decode or colocated
instance, which share the model and tokenizer), ``GET /health`` (200 iff each pool has a healthy instance, else 503),
``GET /version`` (pdserve's version, open like ``/health``) and ``GET /metrics``
(Prometheus text, :mod:`pdserve.serving.proxy.metrics`).

Request bodies: over ``max_request_body_bytes`` (``--max-request-body-bytes``, 32 MiB by
default, as on the instances) they are answered 413 before they are read
(:mod:`pdserve.serving.body_limit`); a body that is not a JSON object, JSON nested too
deep to parse included, is a 400; a client that disconnects mid-upload ends its request
quietly.

With an API key, every ``/v1/*`` route needs ``Authorization: Bearer KEY`` (401
otherwise). Upstream, the proxy sends ``--upstream-api-key`` if given, else the
client's own ``Authorization`` header.

The proxy signs the ``kv_transfer_params`` of both legs with the topology's secret
(``PDSERVE_PD_SECRET``, :mod:`pdserve.core_types.pd_auth`); without it a P/D app
refuses to be built, since every instance would refuse the legs. A colocated proxy
signs nothing and needs no secret; it drops any ``kv_transfer_params`` a client sent.

Lifecycle of an app from :func:`build_proxy_app`: lifespan startup opens the upstream
client (:mod:`pdserve.serving.proxy.upstream`), runs one health round (so ``/health`` is
truthful from the first request) and starts the health probes
(:mod:`pdserve.serving.proxy.health`) and the heap trimmer
(:mod:`pdserve.serving.proxy.heap_trim`); lifespan shutdown stops them, lets pending
KV-release calls finish (bounded) and closes the client.
:func:`pdserve.serving.proxy.cli.main` serves the app.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import quote

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pdserve
from pdserve.core_types.pd_auth import SECRET_ENV, load_secret
from pdserve.serving.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimitMiddleware
from pdserve.serving.http import (
    MAX_REQUEST_ID_LEN,
    error_response,
    send_error_json,
    valid_request_id,
)
from pdserve.serving.proxy.core import ProxyCore, ProxySettings, classify_error
from pdserve.serving.proxy.forward import ProxyResponse
from pdserve.serving.proxy.health import (
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_HEALTH_TIMEOUT_S,
    HealthChecker,
)
from pdserve.serving.proxy.heap_trim import HeapTrimmer
from pdserve.serving.proxy.metrics import ProxyMetrics
from pdserve.serving.proxy.pool import DEFAULT_FAILURE_THRESHOLD, InstancePool, normalize_urls
from pdserve.serving.proxy.spec_stats import DEFAULT_SPEC_SCRAPE_INTERVAL_S, SpecScraper, SpecStats
from pdserve.serving.proxy.upstream import POOL_KEEP_ALIVE_S

logger = logging.getLogger(__name__)

_MODELS_TIMEOUT_S = 30.0


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return error_response(status, message, param, headers=headers)


class _ProxyError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _positive(name: str, value: float) -> float:
    if not value > 0:  # also rejects NaN
        raise ValueError(f"{name} must be > 0 seconds, got {value}")
    return float(value)


def _secret(secret: bytes | None) -> bytes:
    if secret is None:
        secret = load_secret()  # ValueError if set but too short
    if secret is None:
        raise ValueError(
            f"{SECRET_ENV} is not set: instances accept kv_transfer_params only when "
            "they are signed with the topology's secret, so the proxy needs the same "
            f"{SECRET_ENV} as every prefill and decode instance (pdserve launch "
            "generates one and passes it to all of them; by hand: python -c "
            "'import secrets; print(secrets.token_hex(32))')"
        )
    return secret


def _pool_urls(
    prefill_urls: Sequence[str], decode_urls: Sequence[str], colocated_urls: Sequence[str]
) -> dict[str, list[str]]:
    """The validated URLs of each pool: ``prefill`` and ``decode``, or ``colocated``."""
    if colocated_urls:
        if prefill_urls or decode_urls:
            raise ValueError(
                "--colocated cannot be combined with --prefill/--decode: a proxy fronts "
                "either prefill and decode instances or colocated ones (run one proxy for "
                "each deployment)"
            )
        return {"colocated": normalize_urls(colocated_urls, what="--colocated")}
    if not prefill_urls and not decode_urls:
        raise ValueError(
            "no instances: give --prefill URL... and --decode URL... (a P/D deployment) "
            "or --colocated URL... (instances that serve whole requests)"
        )
    return {
        "prefill": normalize_urls(prefill_urls, what="--prefill"),
        "decode": normalize_urls(decode_urls, what="--decode"),
    }


def build_proxy_app(
    prefill_urls: Sequence[str] = (),
    decode_urls: Sequence[str] = (),
    *,
    colocated_urls: Sequence[str] = (),
    api_key: str | None = None,
    upstream_api_key: str | None = None,
    health_interval: float = DEFAULT_HEALTH_INTERVAL_S,
    spec_scrape_interval: float = DEFAULT_SPEC_SCRAPE_INTERVAL_S,
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
    request_timeout: float = 600.0,
    connect_timeout: float = 10.0,
    release_timeout: float = 5.0,
    queue_timeout: float = 30.0,
    pool_keep_alive: float = POOL_KEEP_ALIVE_S,
    pool_name: str = "pdserve",
    secret: bytes | None = None,
    max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    """The proxy app. Raises ``ValueError`` with a clear message for bad arguments.

    Pools: ``prefill_urls`` and ``decode_urls`` (P/D), or ``colocated_urls`` alone.
    URLs may be ``http(s)://host:port[/prefix]`` or ``host:port``; each pool needs at
    least one and no duplicates. The app's :class:`ProxyCore` is ``app.state.proxy``.
    ``secret`` signs ``kv_transfer_params`` (default: ``PDSERVE_PD_SECRET``, required
    for P/D). ``queue_timeout`` may be 0 (answer 503 at once when a pool has no healthy
    instance).
    """
    urls = _pool_urls(prefill_urls, decode_urls, colocated_urls)
    colocated = "colocated" in urls
    for name, key in (("--api-key", api_key), ("--upstream-api-key", upstream_api_key)):
        if key is not None and not key.strip():
            raise ValueError(f"{name} must not be empty")
    if isinstance(failure_threshold, bool) or not (
        isinstance(failure_threshold, int) and failure_threshold >= 1
    ):
        raise ValueError(f"--failure-threshold must be an integer >= 1, got {failure_threshold}")
    if not queue_timeout >= 0:
        raise ValueError(f"--queue-timeout must be >= 0 seconds, got {queue_timeout}")
    if max_request_body_bytes is not None and max_request_body_bytes < 1:
        raise ValueError(
            f"--max-request-body-bytes must be >= 1 (0 on the command line: no limit), "
            f"got {max_request_body_bytes}"
        )
    settings = ProxySettings(
        request_timeout=_positive("--request-timeout", request_timeout),
        connect_timeout=_positive("--connect-timeout", connect_timeout),
        release_timeout=_positive("release timeout", release_timeout),
        queue_timeout=float(queue_timeout),
        failure_threshold=failure_threshold,
        pool_keep_alive=_positive("pool keep-alive", pool_keep_alive),
        upstream_api_key=upstream_api_key,
    )
    metrics = ProxyMetrics(
        urls.get("prefill", ()),
        urls.get("decode", ()),
        colocated_urls=urls.get("colocated", ()),
        pool_name=pool_name,
    )

    def pool(role: str, urls: list[str]) -> InstancePool:
        return InstancePool(
            role,
            urls,
            failure_threshold=failure_threshold,
            on_in_flight=lambda url, n: metrics.set_in_flight(role, url, n),
            on_health=lambda url, ok: metrics.set_healthy(role, url, ok),
        )

    if colocated and secret is None:  # it signs nothing: the secret is optional
        secret = load_secret() or b""
    answer = "colocated" if colocated else "decode"
    core = ProxyCore(
        answer=pool(answer, urls[answer]),
        prefill=None if colocated else pool("prefill", urls["prefill"]),
        metrics=metrics,
        settings=settings,
        secret=_secret(secret),
    )
    health = HealthChecker(
        core.pools,
        core.upstream,
        interval=_positive("--health-interval", health_interval),
        timeout=_positive("--health-timeout", health_timeout),
    )

    spec_stats = SpecStats(urls)
    metrics.registry.register(spec_stats)

    def scrape_headers() -> dict[str, str]:
        key = settings.upstream_api_key
        return {"Authorization": f"Bearer {key}"} if key is not None else {}

    spec_scraper = SpecScraper(
        core.pools,
        core.upstream,
        spec_stats,
        scrape_headers,
        interval=_positive("--spec-scrape-interval", spec_scrape_interval),
        timeout=_positive("--health-timeout", health_timeout),
    )
    trimmer = HeapTrimmer()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await core.open()
        try:
            await health.check_all()
            for pool in core.pools:
                if pool.num_healthy == 0:
                    logger.warning("no healthy %s instance yet (of %d)", pool.role, len(pool))
            health.start()
            spec_scraper.start()
            trimmer.start()
            yield
        finally:
            await trimmer.stop()
            await spec_scraper.stop()
            await health.stop()
            await core.close()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(
        BodyLimitMiddleware, max_body_bytes=max_request_body_bytes, send_error=send_error_json
    )
    app.state.proxy = core
    app.state.health = health
    app.state.spec_stats = spec_stats

    @app.exception_handler(_ProxyError)
    async def _proxy_error(_: Request, exc: _ProxyError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this, so the server logs the traceback
        return _error(500, "internal proxy error")

    def check_auth(request: Request) -> str | None:
        """The client's Authorization header; raises 401 if a key is required and wrong."""
        auth = request.headers.get("authorization")
        if api_key is not None:
            expected = f"Bearer {api_key}".encode()
            if auth is None or not secrets.compare_digest(auth.encode(), expected):
                raise _ProxyError(
                    401, "invalid or missing API key (send 'Authorization: Bearer KEY')"
                )
        return auth

    def forwarded(path: str) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            arrival = time.perf_counter()
            auth = check_auth(request)
            body = _parse_body(await request.body(), pd=not colocated)
            request_id = _request_id(request.headers.get("x-request-id"))
            return ProxyResponse(
                core, path, body, request_id=request_id, authorization=auth, arrival=arrival
            )

        return handler

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        app.add_api_route(path, forwarded(path), methods=["POST"])

    async def passed_on(request: Request) -> Response:
        """Answered by one instance as it is: the model list or card, (de)tokenization."""
        headers = core.upstream_headers(_request_id(None), check_auth(request))
        body = await request.body() if request.method == "POST" else None
        if body is not None:
            headers["Content-Type"] = "application/json"
        path = quote(request.url.path, safe="/:@")  # a model id as the client wrote it
        return await _forward_one(core, request.method, path, headers, body)

    for path in ("/v1/models", "/v1/models/{model_id:path}"):
        app.add_api_route(path, passed_on, methods=["GET"])
    for path in ("/tokenize", "/detokenize"):
        app.add_api_route(path, passed_on, methods=["POST"])

    @app.get("/health")
    async def health_route() -> Response:
        pools = {p.role: {"healthy": p.num_healthy, "total": len(p)} for p in core.pools}
        down = [role for role, c in pools.items() if c["healthy"] == 0]
        if down:
            return _error(503, f"no healthy instance in pool(s): {', '.join(down)}")
        return JSONResponse({"status": "ok", **pools})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/version")
    async def version_route() -> JSONResponse:
        return JSONResponse({"version": pdserve.__version__})

    return app


def _parse_body(raw: bytes, *, pd: bool) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep to parse
        why = "nested too deeply" if isinstance(e, RecursionError) else "not valid JSON"
        raise _ProxyError(400, f"request body is {why}") from None
    if not isinstance(body, dict):
        raise _ProxyError(400, "request body must be a JSON object")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _ProxyError(400, "'stream' must be a boolean", "stream")
    if pd and body.get("prompt_logprobs") is not None:  # refused before any prefill work
        raise _ProxyError(
            400,
            "prompt_logprobs is not supported through the P/D proxy: the decode instance "
            "receives the prompt's KV from a prefill instance and never computes the "
            "prompt's logits (send it to an instance directly)",
            "prompt_logprobs",
        )
    if body.get("echo") is True and body.get("logprobs") is not None:  # the same, echoed
        raise _ProxyError(
            400,
            "echo=true with logprobs is not supported through the P/D proxy: it returns the "
            "prompt's logprobs, which the decode instance never computes (it receives the "
            "prompt's KV from a prefill instance; send it to an instance directly)",
            "echo",
        )
    return body


def _request_id(header: str | None) -> str:
    """The client's ``X-Request-Id`` (validated) or a fresh one."""
    if header is None or header == "":
        return secrets.token_hex(16)
    if not valid_request_id(header):
        raise _ProxyError(
            400,
            f"X-Request-Id must be 1-{MAX_REQUEST_ID_LEN} visible ASCII characters",
            "X-Request-Id",
        )
    return header


async def _forward_one(
    core: ProxyCore, method: str, path: str, headers: dict[str, str], body: bytes | None
) -> Response:
    """``method path`` on the least-loaded healthy decode (or colocated) instance, its
    answer as it is; on a connection failure (one more failure of that instance) the next
    one is tried."""
    pool = core.answer
    tried: list[str] = []
    timeout = aiohttp.ClientTimeout(total=_MODELS_TIMEOUT_S)
    while (inst := pool.pick(exclude=tried)) is not None:
        tried.append(inst.url)
        try:
            resp = await core.upstream.request(
                method,
                inst.url + path,
                instance=inst.url,
                headers=headers,
                timeout=timeout,
                data=body,
            )
            async with resp:
                data = await resp.read()
                ctype = resp.headers.get("Content-Type", "application/json")
            pool.record_success(inst)
            return Response(data, status_code=resp.status, media_type=ctype)
        except Exception as e:
            _, unreachable = classify_error(e)
            if unreachable:
                pool.record_failure(inst, f"{type(e).__name__}: {e}")
            logger.warning("%s %s on %s failed: %r", method, path, inst.url, e)
    if tried:
        return _error(502, f"{method} {path} failed on {', '.join(tried)}")
    core.metrics.unavailable(pool.role)
    return _error(503, f"no healthy {pool.role} instance (0 of {len(pool)} healthy)")
