"""Fake instances (``fake_instance.py``) and ``pdserve proxy`` as child processes, and a
paced load driver, for the proxy tests that need real processes (signals, soak)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

FAKE_INSTANCE = Path(__file__).with_name("fake_instance.py")


@dataclass
class Proc:
    proc: subprocess.Popen[str]
    url: str
    log: Path

    def stats(self) -> dict[str, int]:
        return httpx.get(self.url + "/stats", timeout=5).json()  # type: ignore[no-any-return]

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot exit
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _start(cmd: Sequence[str], log: Path, pattern: str, timeout: float = 30) -> Proc:
    """Start ``cmd``; its first stdout line must match ``pattern`` (group 1: the URL)."""
    with log.open("w") as err:
        proc = subprocess.Popen(
            list(cmd), stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line:
            break
    m = re.search(pattern, line)
    if m is None:
        proc.kill()
        raise RuntimeError(f"{cmd[1:3]} did not start: {line!r} {log.read_text()[-2000:]}")
    return Proc(proc, m.group(1), log)


def start_fake(role: str, log: Path, *args: str) -> Proc:
    cmd = [sys.executable, str(FAKE_INSTANCE), role, *args]
    p = _start(cmd, log, r"PORT (\d+)")
    p.url = f"http://127.0.0.1:{p.url}"
    return p


def start_proxy(prefill: Sequence[str], decode: Sequence[str], log: Path, *args: str) -> Proc:
    cmd = [sys.executable, "-m", "pdserve.serving.proxy", "--prefill", *prefill]
    cmd += ["--decode", *decode]
    cmd += ["--port", "0", *args]
    p = _start(cmd, log, r"(http://127\.0\.0\.1:\d+)")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(p.url + "/health", timeout=2).status_code == 200:
                return p
        time.sleep(0.1)
    p.stop()
    raise RuntimeError(f"proxy not healthy: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def running(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            p.stop()


def metric_sum(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        head = line.split("{")[0].split(" ")[0]
        if head == name and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- the load driver --------------------------------------------------------------------


@dataclass
class SoakResult:
    sent: int = 0
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)


async def _one(s: aiohttp.ClientSession, url: str, i: int, res: SoakResult) -> None:
    stream = i % 2 == 0
    body = {"model": "fake", "prompt": f"p{i}", "max_tokens": 4, "stream": stream}
    try:
        async with s.post(url + "/v1/completions", json=body) as r:
            data = await r.read()
        if r.status != 200:
            res.failures.append(f"#{i}: {r.status} {data[:300]!r}")
        elif stream and not data.endswith(b"data: [DONE]\n\n"):
            res.failures.append(f"#{i}: stream without [DONE]: {data[-300:]!r}")
        elif not stream and "choices" not in json.loads(data):
            res.failures.append(f"#{i}: {data[:300]!r}")
        else:
            res.ok += 1
    except (aiohttp.ClientError, TimeoutError) as e:
        res.failures.append(f"#{i}: {type(e).__name__}: {e}")


async def soak(
    url: str, n: int, rate: float, gaps: dict[int, float], seed: int = 0, burst: int = 1
) -> SoakResult:
    """``n`` requests (half streamed) at ``rate`` per second on average, sent ``burst``
    at a time (exponential times between bursts), so several are in flight at once and
    the proxy pools several connections per instance; before request ``i`` in ``gaps``
    the driver lets everything finish and then sends nothing for ``gaps[i]`` seconds.
    Each request is bounded by a 30 s client timeout."""
    rng = random.Random(seed)
    res = SoakResult()
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        pending: set[asyncio.Task[None]] = set()
        next_at = loop.time()
        for i in range(n):
            if i in gaps:
                if pending:
                    await asyncio.wait(pending)
                await asyncio.sleep(gaps[i])
                res.gaps.append(gaps[i])
                next_at = loop.time()
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            task = asyncio.create_task(_one(s, url, i, res))
            pending.add(task)
            task.add_done_callback(pending.discard)
            res.sent += 1
            if (i + 1) % burst == 0:
                next_at += rng.expovariate(rate / burst)
        if pending:
            await asyncio.wait(pending)
    return res


def gap_plan(n: int, short: int, long: int, seed: int = 0) -> dict[int, float]:
    """``short`` gaps of 4.9-5.1 s and ``long`` of 14.9-15.1 s at random positions."""
    rng = random.Random(seed)
    where = rng.sample(range(50, n - 10), short + long)
    lengths = [rng.uniform(4.9, 5.1) for _ in range(short)]
    lengths += [rng.uniform(14.9, 15.1) for _ in range(long)]
    return dict(zip(where, lengths, strict=True))
