"""Tokenization off the event loop with bounded concurrency: a huge ``/tokenize`` does not
stall an authenticated small completion, and large jobs never take every thread."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from _polling import wait_until
from pdserve.serving.api.workers import BlockingPool

from .conftest import FakeEngineClient, ServerFactory


def test_large_jobs_leave_a_thread_for_small_ones() -> None:
    async def run() -> list[str]:
        pool = BlockingPool(threads=2, large_job=100)
        release = threading.Event()
        order: list[str] = []

        def job(name: str, wait: bool) -> str:
            order.append(f"start {name}")
            if wait:
                assert release.wait(10)
            order.append(f"end {name}")
            return name

        big1 = asyncio.ensure_future(pool.run(job, "big1", True, job_size=100))
        await asyncio.sleep(0.05)
        big2 = asyncio.ensure_future(pool.run(job, "big2", False, job_size=10**6))
        await asyncio.sleep(0.05)
        assert await pool.run(job, "small", False, job_size=5) == "small"
        assert "start big2" not in order  # one large slot for two threads
        release.set()
        assert await asyncio.gather(big1, big2) == ["big1", "big2"]
        pool.close()
        return order

    order = asyncio.run(run())
    assert order.index("end small") < order.index("end big1") < order.index("start big2")


def test_a_cancelled_caller_keeps_its_slot_until_the_thread_is_done() -> None:
    async def run() -> None:
        pool = BlockingPool(threads=2, large_job=1)
        release = threading.Event()
        started = threading.Event()

        def slow() -> None:
            started.set()
            assert release.wait(10)

        task = asyncio.ensure_future(pool.run(slow, job_size=1))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        second = asyncio.ensure_future(pool.run(lambda: "second", job_size=1))
        await asyncio.sleep(0.1)
        assert not second.done()  # the first job still runs in its thread
        release.set()
        assert await asyncio.wait_for(second, 5) == "second"
        pool.close()

    asyncio.run(run())


def test_pool_needs_two_threads() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        BlockingPool(threads=1)


def test_huge_tokenize_does_not_stall_a_small_completion(
    tiny_llama: Path, make_server: ServerFactory
) -> None:
    from pdserve.frontend.tokenizer import Tokenizer

    engine = FakeEngineClient(Tokenizer.from_pretrained(tiny_llama), max_model_len=10**7)
    srv = make_server(engine, api_key="k")
    auth = {"Authorization": "Bearer k"}
    text = "the quick brown fox jumps over a lazy dog. " * 70_000  # 3 MB: seconds to tokenize
    done: list[float] = []
    result: list[httpx.Response] = []

    def huge() -> None:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            result.append(c.post("/tokenize", json={"prompt": text}, headers=auth))
        done.append(time.monotonic())

    t = threading.Thread(target=huge)
    t.start()
    pool = srv.server.ctx.pool

    def tokenizing() -> bool:  # the huge job holds the one large slot
        slots = pool._large_slots
        return slots is not None and slots.locked()

    assert wait_until(tokenizing, timeout=10)
    latencies = []
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for i in range(5):
            start = time.monotonic()
            r = c.post(
                "/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 2}, headers=auth
            )
            latencies.append(time.monotonic() - start)
            assert r.status_code == 200, r.text
        finished_small = time.monotonic()
    t.join(120)
    assert result and result[0].status_code == 200, result
    assert result[0].json()["count"] > 100_000
    assert done[0] > finished_small, "the huge tokenize ended first: it proved nothing"
    print(f"small completions during a huge tokenize: {[round(x * 1000) for x in latencies]} ms")
    assert max(latencies) < 0.5, latencies
