"""HTTP plumbing around the benchmark: session, model discovery, readiness polling.

Only the OpenAI-compatible surface is used (``/v1/models``, ``/health``), so it
works against vLLM, SGLang and pdserve alike.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from pdserve.bench.errors import BenchError

# Generous: a long run at a saturated server may keep one stream open for hours.
SESSION_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60, sock_connect=60)
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=10)


def make_session(max_concurrency: int | None) -> aiohttp.ClientSession:
    """One pooled session for the whole run; the pool is capped at ``max_concurrency``.

    ``trust_env=False``: proxies from the environment must never sit between the
    client and the server under test.
    """
    limit = max_concurrency or 0
    connector = aiohttp.TCPConnector(
        limit=limit,
        limit_per_host=limit,
        keepalive_timeout=60,
        enable_cleanup_closed=True,
        force_close=False,
    )
    return aiohttp.ClientSession(connector=connector, timeout=SESSION_TIMEOUT, trust_env=False)


async def get_first_model(base_url: str, headers: dict[str, str]) -> tuple[str, str]:
    """``(id, root)`` of the first entry of ``GET /v1/models`` (root falls back to id)."""
    url = f"{base_url}/v1/models"
    try:
        async with (
            aiohttp.ClientSession(timeout=_PROBE_TIMEOUT, trust_env=False) as session,
            session.get(url, headers=headers) as resp,
        ):
            resp.raise_for_status()
            data: Any = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise BenchError(
            f"--model not given and GET {url} failed ({exc}); is the server running "
            "at that address? Pass --model to skip the lookup."
        ) from exc
    models = data.get("data") if isinstance(data, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise BenchError(f"GET {url} returned no models; pass --model explicitly")
    model_id = str(models[0]["id"])
    root = models[0].get("root")
    return model_id, str(root) if root else model_id


async def wait_until_ready(
    base_url: str, headers: dict[str, str], timeout_s: float, poll_interval_s: float = 1.0
) -> None:
    """Poll ``/health`` then ``/v1/models`` until one answers 200, or raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_error = "no attempt made"
    async with aiohttp.ClientSession(timeout=_PROBE_TIMEOUT, trust_env=False) as session:
        while True:
            for path in ("/health", "/v1/models"):
                try:
                    async with session.get(f"{base_url}{path}", headers=headers) as resp:
                        if resp.status == 200:
                            return
                        last_error = f"GET {path} -> HTTP {resp.status}"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    last_error = f"GET {path} -> {type(exc).__name__}: {exc}"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(
                    f"server at {base_url} not ready after {timeout_s:g} s ({last_error})"
                )
            await asyncio.sleep(min(poll_interval_s, remaining))
