"""Issue-level acceptance on a live ``pdserve serve`` process (tiny model, CPU, loopback)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from _polling import wait_until

from .conftest import LiveServer, start_server

VLLM_RESULT_KEYS = {
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "mean_ttft_ms",
    "median_ttft_ms",
    "std_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "std_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "std_itl_ms",
    "p99_itl_ms",
    "latencies",
}


def test_openai_client_completes_and_streams(live_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", timeout=30)
    c = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert c.usage is not None and c.usage.completion_tokens == 7
    assert c.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    prompt_tokens = chunks[-1].usage.prompt_tokens
    toks = client.post(
        "/../tokenize",
        cast_to=object,
        body={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert toks["count"] == prompt_tokens  # type: ignore[index]


def test_bench_serve_against_live_server(
    live_server: LiveServer, tiny_llama: Path, tmp_path: Path
) -> None:
    rate, n, out_len = 20.0, 200, 8
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "bench",
            "serve",
            "--base-url",
            live_server.url,
            "--model",
            "tiny",
            "--tokenizer",
            str(tiny_llama),
            "--dataset-name",
            "random",
            "--random-input-len",
            "32",
            "--random-output-len",
            str(out_len),
            "--num-prompts",
            str(n),
            "--request-rate",
            str(rate),
            "--seed",
            "1",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Serving Benchmark Result" in proc.stdout
    res = json.loads((tmp_path / "r.json").read_text())
    assert set(res) >= VLLM_RESULT_KEYS, VLLM_RESULT_KEYS - set(res)
    assert res["completed"] == n and res["failed"] == 0
    assert res["total_output_tokens"] == n * out_len  # from usage, ignore_eos forced
    assert abs(res["request_throughput"] - rate) / rate < 0.05, res["request_throughput"]


async def _stream_then_drop(url: str, i: int, started: asyncio.Event, counter: list[int]) -> None:
    body = {
        "model": "tiny",
        "prompt": f"request number {i} " * 4,
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
    }
    async with (
        httpx.AsyncClient(timeout=30) as c,
        c.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        got = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 2:
                    counter[0] += 1
                    if counter[0] == 50:
                        started.set()
                    await started.wait()
                    return  # leaves the stream: the connection is closed mid-stream


def test_disconnected_streams_free_their_kv(live_server: LiveServer) -> None:
    async def run() -> None:
        started = asyncio.Event()
        counter = [0]
        await asyncio.wait_for(
            asyncio.gather(
                *(_stream_then_drop(live_server.url, i, started, counter) for i in range(50))
            ),
            120,
        )

    asyncio.run(run())
    assert wait_until(
        lambda: (
            live_server.metric("pdserve:kv_cache_usage_perc") == 0.0
            and live_server.metric("pdserve:num_requests_running") == 0.0
        ),
        timeout=1.0,
        step=0.05,
    )
    r = httpx.post(
        f"{live_server.url}/v1/completions",
        json={"model": "tiny", "prompt": "still there?", "max_tokens": 3},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_sigterm_under_load_drains_and_exits_zero(tiny_llama: Path, tmp_path: Path) -> None:
    srv = start_server(tiny_llama, tmp_path, "--shutdown-timeout", "60")

    async def one(i: int, results: list) -> None:
        body = {"model": "tiny", "prompt": f"load {i}", "max_tokens": 600, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.post(f"{srv.url}/v1/completions", json=body)
            results.append((r.status_code, r.json()))

    async def run() -> tuple[list, int]:
        results: list = []
        tasks = [asyncio.create_task(one(i, results)) for i in range(8)]
        ok = await asyncio.to_thread(
            wait_until, lambda: srv.metric("pdserve:num_requests_running") >= 1, 20
        )
        assert ok
        srv.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(timeout=10) as c:
            late = await c.post(
                f"{srv.url}/v1/completions",
                json={"model": "tiny", "prompt": "late", "max_tokens": 2},
            )
        await asyncio.gather(*tasks)
        return results, late.status_code

    results, late_status = asyncio.run(run())
    assert late_status == 503
    assert len(results) == 8
    for status, body in results:
        assert status == 200
        assert body["usage"]["completion_tokens"] == 600
    assert srv.proc.wait(60) == 0
