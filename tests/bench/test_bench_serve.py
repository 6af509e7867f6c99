"""End to end against a fake OpenAI streaming server on loopback (bounded requests)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.endpoint import wait_until_ready
from pdserve.bench.errors import BenchError
from pdserve.bench.records import RequestInput
from pdserve.bench.request_func import request_openai_completions
from pdserve.bench.serve import add_cli_args, main, run_benchmark

VLLM_KEYS = {
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
    "latencies",
}
DETAILED = {
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "start_times",
    "generated_texts",
    "errors",
}


def _common(url: str, tok: Path, **kw: Any) -> dict[str, Any]:
    flags: dict[str, Any] = {
        "base_url": url,
        "model": "fake-model",
        "tokenizer": str(tok),
        "random_input_len": 12,
        "random_output_len": 5,
        "disable_tqdm": True,
        "request_id_prefix": "t-",
        "save_detailed": True,
    }
    flags.update(kw)
    return flags


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_completions_timing_usage_and_payload(
    fake_server: Callable[..., Any], tiny_tokenizer_dir: Path
) -> None:
    srv = fake_server(ttft_s=0.12, itl_s=0.04)
    res = run_benchmark(
        **_common(srv.url, tiny_tokenizer_dir, num_prompts=4),
        percentile_metrics="ttft,tpot,itl,e2el",
    )
    assert (res["completed"], res["failed"]) == (4, 0)
    assert res["output_lens"] == [5] * 4  # usage.completion_tokens
    assert res["input_lens"] == [11 + 1] * 4  # usage.prompt_tokens replaces the local 11
    assert res["total_input_tokens"] == 48 and res["total_output_tokens"] == 20
    assert 115 <= res["mean_ttft_ms"] < 250
    assert 35 <= res["mean_itl_ms"] < 90
    assert 35 <= res["mean_tpot_ms"] < 90
    assert 270 <= res["mean_e2el_ms"] < 500  # 120 + 4*40; usage chunk and [DONE] excluded
    assert all(len(itl) == 4 for itl in res["itls"])
    assert all(t == " a0 a1 a2 a3 a4" for t in res["generated_texts"])
    assert res["max_concurrent_requests"] == 4
    assert res["request_goodput"] is None
    body = srv.payloads[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == 5
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert isinstance(body["prompt"], str)
    assert sorted(h["x-request-id"] for h in srv.headers) == ["t-0", "t-1", "t-2", "t-3"]


def test_chat_backend(fake_server: Callable[..., Any], tiny_tokenizer_dir: Path) -> None:
    srv = fake_server(ttft_s=0.05, itl_s=0.02)
    res = run_benchmark(
        **_common(srv.url, tiny_tokenizer_dir, num_prompts=3, backend="openai-chat"),
        temperature=0.7,
        top_p=0.9,
    )
    assert res["completed"] == 3 and res["endpoint_type"] == "openai-chat"
    assert res["output_lens"] == [5] * 3
    # the role-only first delta carries choices, so it stops the TTFT clock (vLLM rule)
    assert all(len(itl) == 5 for itl in res["itls"])
    body = srv.payloads[0]
    assert body["messages"][0]["role"] == "user"
    assert isinstance(body["messages"][0]["content"], str)
    assert body["max_completion_tokens"] == 5 and "max_tokens" not in body
    assert (body["temperature"], body["top_p"]) == (0.7, 0.9)


def test_failures_dropped_and_reported(
    fake_server: Callable[..., Any], tiny_tokenizer_dir: Path
) -> None:
    modes = {1: "http500", 3: "no_choices"}
    srv = fake_server(ttft_s=0.05, itl_s=0.01, mode_of=lambda i: modes.get(i % 5, "ok"))
    res = run_benchmark(**_common(srv.url, tiny_tokenizer_dir, num_prompts=10))
    assert (res["completed"], res["failed"]) == (6, 4)
    errs = res["errors"]
    assert "HTTP 500" in errs[1] and "boom" in errs[1]
    assert "Never received a valid chunk" in errs[3]
    assert errs[0] == ""
    assert res["total_output_tokens"] == 30 and res["output_lens"][1] == 0
    assert res["total_input_tokens"] == 6 * 12  # successful requests only
    assert res["mean_ttft_ms"] >= 45  # failed requests' zero TTFTs are not averaged in


def test_usage_absent_falls_back_to_tokenizer(
    fake_server: Callable[..., Any], tiny_tokenizer_dir: Path
) -> None:
    srv = fake_server(ttft_s=0.02, itl_s=0.005, include_usage=False)
    res = run_benchmark(**_common(srv.url, tiny_tokenizer_dir, num_prompts=2))
    assert res["output_lens"] == [5, 5]  # re-tokenized " a0 a1 a2 a3 a4"
    assert res["input_lens"] == [11, 11]  # local count kept


def test_rate_and_concurrency_cap(
    fake_server: Callable[..., Any], tiny_tokenizer_dir: Path
) -> None:
    srv = fake_server(ttft_s=0.05, itl_s=0.01, num_tokens=3)
    res = run_benchmark(
        **_common(srv.url, tiny_tokenizer_dir, num_prompts=8),
        request_rate=40.0,
        burstiness=2.0,
        max_concurrency=2,
        percentile_metrics="ttft,e2el,client_queue_time,e2el_including_client_queue",
    )
    assert res["completed"] == 8
    assert res["max_concurrent_requests"] <= 2
    assert res["duration"] >= 8 / 40.0
    assert (res["request_rate"], res["burstiness"], res["max_concurrency"]) == (40.0, 2.0, 2)
    assert "mean_client_queue_time_ms" in res and "p99_e2el_including_client_queue_ms" in res
    assert len(res["queue_times"]) == 8
    starts = sorted(res["start_times"])
    assert starts[-1] - starts[0] >= 0.1  # arrivals were spread, not all at t=0


def test_saved_json_has_vllm_keys(
    fake_server: Callable[..., Any], tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    srv = fake_server(ttft_s=0.02, itl_s=0.005)
    flags = _common(srv.url, tiny_tokenizer_dir, num_prompts=3, save_detailed=False)
    flags["model"] = None  # discovered from /v1/models
    res = run_benchmark(
        **flags,
        save_result=True,
        result_dir=str(tmp_path / "out"),
        metadata=["site=lab", "tp=1"],
        goodput=["ttft:5000", "tpot:1000"],
        percentile_metrics="ttft,tpot,itl,e2el",
        metric_percentiles="50,99.9",
    )
    files = list((tmp_path / "out").glob("*.json"))
    assert len(files) == 1
    assert re.fullmatch(r"openai-infqps-fake-model-\d{8}-\d{6}\.json", files[0].name)
    saved = json.loads(files[0].read_text())
    assert saved == json.loads(json.dumps(res))
    assert saved.keys() >= VLLM_KEYS
    assert not DETAILED & saved.keys()
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{stat}_{metric}_ms" in saved
    assert saved["model_id"] == "fake-org/fake-model" and saved["request_rate"] == "inf"
    assert saved["tokenizer_id"] == str(tiny_tokenizer_dir)
    assert (saved["site"], saved["tp"]) == ("lab", "1")
    assert saved["request_goodput"] == pytest.approx(3 / saved["duration"])
    assert srv.payloads[0]["model"] == "fake-model"
    assert list(saved)[:7] == [
        "date",
        "endpoint_type",
        "backend",
        "label",
        "model_id",
        "tokenizer_id",
        "num_prompts",
    ]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve")
    add_cli_args(p)
    return p


def test_cli_refuses_unimplemented(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--dataset-name", "sharegpt"],
        ["--dataset-path", "x.json"],
        ["--ramp-up-strategy", "linear"],
        ["--backend", "vllm"],
        ["--max-concurrency", "0"],
        ["--request-rate", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            _parser().parse_args(argv)
        assert exc.value.code == 2
    assert "invalid choice: 'sharegpt'" in capsys.readouterr().err
    args = _parser().parse_args([])
    assert (args.endpoint, args.num_prompts, args.request_rate) == (None, 1000, float("inf"))
    assert (args.random_input_len, args.random_output_len, args.metric_percentiles) == (
        1024,
        128,
        "99",
    )


def test_cli_main(
    fake_server: Callable[..., Any],
    tiny_tokenizer_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    srv = fake_server(ttft_s=0.02, itl_s=0.005, health_failures=0)
    base = ["--base-url", srv.url, "--tokenizer", str(tiny_tokenizer_dir), "--disable-tqdm"]
    base += ["--random-input-len", "8", "--random-output-len", "3", "--num-prompts", "2"]
    out_file = tmp_path / "r.json"
    argv = [*base, "--save-result", "--result-filename", str(out_file), "--label", "L"]
    argv += ["--ready-check-timeout-sec", "5", "--max-concurrency", "1"]
    assert main(_parser().parse_args(argv)) == 0
    text = capsys.readouterr().out
    for line in (
        "============ Serving Benchmark Result ============",
        "Successful requests:",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Peak output token throughput (tok/s):",
        "Peak concurrent requests:",
        "Total token throughput (tok/s):",
        "---------------Time to First Token----------------",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P99 TTFT (ms):",
        "-----Time per Output Token (excl. 1st token)------",
        "---------------Inter-token Latency----------------",
        "==================================================",
    ):
        assert line in text
    saved = json.loads(out_file.read_text())
    assert saved["label"] == "L" and saved["max_concurrency"] == 1
    assert srv.headers[0]["authorization"] == "Bearer from-env"

    flag_key = [*base, "--api-key", "sekret", "--backend", "openai-chat"]
    assert main(_parser().parse_args(flag_key)) == 0
    assert srv.headers[-1]["authorization"] == "Bearer sekret"
    printed = capsys.readouterr().out
    assert "sekret" not in printed and "Namespace" not in printed  # no flag dump
    assert "api_key" not in printed and "request_id_prefix" not in printed
    assert srv.payloads[-1]["messages"]  # default endpoint follows the backend

    assert main(_parser().parse_args([*base, "--goodput", "ttft"])) == 2
    bad_endpoint = [*base, "--endpoint", "/v1/chat/completions"]
    assert main(_parser().parse_args(bad_endpoint)) == 2
    assert "openai-chat" in capsys.readouterr().err


def test_all_failed_exit_code(fake_server: Callable[..., Any], tiny_tokenizer_dir: Path) -> None:
    srv = fake_server(mode_of=lambda i: "http500")
    argv = ["--base-url", srv.url, "--model", "m", "--tokenizer", str(tiny_tokenizer_dir)]
    argv += ["--random-input-len", "8", "--num-prompts", "3", "--disable-tqdm"]
    assert main(_parser().parse_args(argv)) == 1


def test_ready_check_polls_then_times_out(fake_server: Callable[..., Any]) -> None:
    srv = fake_server(health_failures=3)
    asyncio.run(wait_until_ready(srv.url, {}, timeout_s=5.0, poll_interval_s=0.02))
    assert srv.health_calls >= 4
    dead = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(BenchError, match="not ready"):
        asyncio.run(wait_until_ready(dead, {}, timeout_s=0.2, poll_interval_s=0.05))


def test_transport_error_is_a_failed_request() -> None:
    async def go() -> Any:
        import aiohttp

        inp = RequestInput(
            prompt="hi",
            api_url=f"http://127.0.0.1:{_closed_port()}/v1/completions",
            prompt_len=1,
            output_len=1,
            model="m",
        )
        async with aiohttp.ClientSession() as session:
            return await request_openai_completions(inp, session)

    out = asyncio.run(go())
    assert not out.success and "Connect" in out.error


def test_unknown_programmatic_option() -> None:
    with pytest.raises(TypeError, match="dataset_path"):
        run_benchmark(dataset_path="x")
