"""The open-loop dispatch loop: warmups, paced arrivals, concurrency cap, gather.

Lifecycle of one run: open one pooled session -> optional warmups (the first
prompt, ``num_warmups`` times, same concurrency cap, results discarded) ->
``before_main()`` -> ``t0 = perf_counter()`` -> for each request in order, wait until
its due time (``arrival_offsets``), then spawn a task that waits for a concurrency slot
and streams the request (``on_complete(output)`` when it ends) -> gather all ->
``duration = perf_counter() - t0`` -> close the session. A request's arrival time is when its task was spawned; its
``client_queue_time`` is ``start_time - arrival`` (time spent waiting for a slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from tqdm import tqdm

from pdserve.bench.arrivals import arrival_offsets, paced
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.endpoint import make_session
from pdserve.bench.records import RequestInput, RequestOutput
from pdserve.bench.request_func import REQUEST_FUNCS, ProgressLike


@dataclass(frozen=True)
class RunSpec:
    """What to send and how fast. ``model`` is the name put in each request body."""

    backend: str
    api_url: str
    model: str
    requests: Sequence[SampleRequest]
    request_rate: float = float("inf")
    burstiness: float = 1.0
    seed: int = 0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    num_warmups: int = 0
    disable_tqdm: bool = False
    # awaited after the warm-ups, right before the clock starts (``bench serve`` reads
    # the server's counters there, so warm-up requests do not count)
    before_main: Callable[[], Awaitable[None]] | None = None
    # called with each finished request's output as it finishes (``soak`` counts them)
    on_complete: Callable[[RequestOutput], None] | None = None


@dataclass(frozen=True)
class RunOutcome:
    """Outputs in request order, and the dispatch-start-to-all-done duration."""

    outputs: list[RequestOutput]
    duration_s: float


def _limiter(max_concurrency: int | None) -> contextlib.AbstractAsyncContextManager[Any]:
    if max_concurrency:
        return asyncio.Semaphore(max_concurrency)
    return contextlib.nullcontext()


def _request_input(spec: RunSpec, req: SampleRequest) -> RequestInput:
    return RequestInput(
        prompt=req.prompt,
        api_url=spec.api_url,
        prompt_len=req.prompt_len,
        output_len=req.expected_output_len,
        model=spec.model,
        ignore_eos=spec.ignore_eos,
        extra_body=dict(spec.extra_body),
        headers=dict(spec.headers),
        request_id=req.request_id or None,
    )


async def _warmup(spec: RunSpec, session: aiohttp.ClientSession) -> None:
    func = REQUEST_FUNCS[spec.backend]
    first = spec.requests[0]
    base = _request_input(spec, first)
    limiter = _limiter(spec.max_concurrency)
    print(f"Warming up with {spec.num_warmups} requests...", flush=True)
    bar = tqdm(total=spec.num_warmups, disable=spec.disable_tqdm)

    async def one(k: int) -> RequestOutput:
        warm = replace(base, request_id=f"{first.request_id}-warmup{k}")
        async with limiter:
            return await func(warm, session, None if spec.disable_tqdm else bar)

    await asyncio.gather(*(one(k) for k in range(spec.num_warmups)))
    bar.close()
    print("Warmup run completed.", flush=True)


async def run_requests(spec: RunSpec) -> RunOutcome:
    """Send ``spec.requests`` on the arrival schedule and collect every output."""
    if not spec.requests:
        raise ValueError("no requests to send")
    func = REQUEST_FUNCS[spec.backend]
    offsets = arrival_offsets(len(spec.requests), spec.request_rate, spec.burstiness, spec.seed)
    inputs = [_request_input(spec, r) for r in spec.requests]
    async with make_session(spec.max_concurrency) as session:
        if spec.num_warmups > 0:
            await _warmup(spec, session)
        if spec.before_main is not None:
            await spec.before_main()
        print("Starting main benchmark run...", flush=True)
        distribution = "Poisson process" if spec.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {spec.request_rate}", flush=True)
        print(f"Burstiness factor: {spec.burstiness} ({distribution})", flush=True)
        print(f"Maximum request concurrency: {spec.max_concurrency}", flush=True)

        limiter = _limiter(spec.max_concurrency)
        bar: tqdm[Any] = tqdm(total=len(inputs), disable=spec.disable_tqdm)
        progress: ProgressLike | None = None if spec.disable_tqdm else bar

        async def limited(inp: RequestInput, arrival: float) -> RequestOutput:
            async with limiter:
                out = await func(inp, session, progress)
            out.client_queue_time = out.start_time - arrival
            if spec.on_complete is not None:
                spec.on_complete(out)
            return out

        t0 = time.perf_counter()
        tasks: list[asyncio.Task[RequestOutput]] = []
        async for inp in paced(inputs, offsets.tolist()):
            tasks.append(asyncio.create_task(limited(inp, time.perf_counter())))
        outputs = list(await asyncio.gather(*tasks))
        bar.close()
        duration = time.perf_counter() - t0
    return RunOutcome(outputs=outputs, duration_s=duration)
