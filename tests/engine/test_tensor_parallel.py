"""--tensor-parallel-size through the engine (gloo, CPU): two ranks give the tokens one
process gives (Llama and GLM-5 with MTP drafts, async and sync scheduling, random and
constrained sampling; FP8 checkpoints of both), refusals before any process starts, and a follower killed
mid-generation ends every request with a clear error and stops the engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.core_types.sampling_params import StructuredOutputsParams
from pdserve.distributed import RankInfo
from pdserve.distributed.device import rank_device
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.tp_workers import RankFailure, TPLeader
from pdserve.frontend.async_client import AsyncEngineClient

KW: dict[str, Any] = dict(
    dtype="float32", block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512
)
PROMPTS = [list(range(5, 10)), list(range(10, 50)), [3, 4]]  # 40 tokens: two chunks


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The single-process reference on one thread, as each of two CPU ranks gets."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=7),  # own stream
        SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),  # the engine's stream
    ]


def _choice() -> list[SamplingParams]:
    so = StructuredOutputsParams(choice=["alpha", "beta gamma"])
    return [SamplingParams(temperature=0, max_tokens=12, structured_outputs=so)] * 3


def test_tp2_llama_gives_the_tokens_of_one_process(tiny_llama: Path, one_thread: None) -> None:
    ref = LLM(str(tiny_llama), **KW)
    want = [_run(ref, _params()), _run(ref, _choice())]
    ref.engine.set_async_scheduling(False)
    want.append(_run(ref, _params()))
    ref.engine.shutdown()

    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **KW)
    try:
        assert llm.engine.tp is not None and llm.engine.runner.model.lm_head.weight.shape[0] == 256
        got = [_run(llm, _params()), _run(llm, _choice())]
        llm.engine.set_async_scheduling(False)  # the followers finish steps as the leader does
        got.append(_run(llm, _params()))
    finally:
        llm.engine.shutdown()
    assert got == want


def test_tp2_glm5_with_mtp_drafts_matches_one_process(tiny_glm5: Path, one_thread: None) -> None:
    greedy = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * len(PROMPTS)
    ref = LLM(str(tiny_glm5), **KW)
    want = _run(ref, greedy)
    ref.engine.shutdown()
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(str(tiny_glm5), tensor_parallel_size=2, speculative_config=spec, **KW)
    try:
        attn = llm.engine.runner.model.model.layers[0].self_attn
        assert attn.num_heads == 2  # of 4: heads split, the latent cache whole
        got = _run(llm, greedy)
        stats = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    assert got == want
    assert stats.spec_num_draft_tokens > 0  # MTP drafted on every rank and they were verified


def test_tp2_fp8_llama_gives_the_tokens_of_one_process(
    tp_fp8_llama: tuple[Path, Path], one_thread: None
) -> None:
    """An FP8 checkpoint whose splits keep whole 128x128 blocks: each rank runs its FP8
    slice (row-parallel inputs quantized per 128 channels as one process does)."""
    fp8 = str(tp_fp8_llama[1])
    greedy = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(PROMPTS)
    ref = LLM(fp8, **KW)
    want = _run(ref, greedy)
    ref.engine.shutdown()
    llm = LLM(fp8, tensor_parallel_size=2, **KW)
    try:
        down = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert down.weight.dtype == torch.float8_e4m3fn and down.weight.shape == (256, 128)
        got = _run(llm, greedy)
    finally:
        llm.engine.shutdown()
    assert got == want


def _gaps(llm: LLM, prompts: list[list[int]], forced: list[list[int]]) -> list[list[float]]:
    """Per forced token: how far (nats) its logprob is below this model's best token at
    that position (0: the model's own greedy choice), scored as a prompt."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(
        [{"prompt_token_ids": p + f} for p, f in zip(prompts, forced, strict=True)], params
    )
    gaps = []
    for p, f, out in zip(prompts, forced, outs, strict=True):
        rows = out.prompt_logprobs[len(p) :]
        gaps.append(
            [
                max(v.logprob for v in row.values()) - row[t].logprob
                for row, t in zip(rows, f, strict=True)
            ]
        )
    return gaps


def test_tp2_fp8_glm5_with_mtp_drafts_follows_one_process(
    tp_fp8_glm5: tuple[Path, Path], one_thread: None
) -> None:
    """GLM-5 FP8 (heads, dense MLP, shared and routed experts split on block boundaries;
    kv_b_proj dequantized), quantized at load, with MTP drafts. Unlike float32 (or Llama
    FP8) the ranks' different summation order (~1e-7) is not always invisible: per-token
    FP8 quantization of every expert's activations turns it into the odd flipped fp8
    rounding, about 1e-2 of the logits after four layers, so on a near-tie greedy decoding may
    part. So: one process's greedy tokens, scored by the two ranks, are the ranks' own
    choice or within 0.05 nats of it, and the ranks' greedy tokens equal one process's
    up to the first such near-tie (where the ranks' scoring agrees with their decoding
    to 1e-3 nats)."""
    plain = str(tp_fp8_glm5[0])
    greedy = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * len(PROMPTS)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    ref = LLM(plain, quantization="fp8", speculative_config=spec, **KW)
    want = _run(ref, greedy)
    ref.engine.shutdown()
    llm = LLM(plain, tensor_parallel_size=2, quantization="fp8", speculative_config=spec, **KW)
    try:
        experts = llm.engine.runner.model.model.layers[1].mlp.experts
        assert experts.fp8 and experts.intermediate_size == 128  # of 256
        got = _run(llm, greedy)
        stats = llm.engine.stats()
        gaps = _gaps(llm, PROMPTS, want)
    finally:
        llm.engine.shutdown()
    assert stats.spec_num_draft_tokens > 0
    assert all(g < 0.05 for row in gaps for g in row), gaps
    for g, w, row in zip(got, want, gaps, strict=True):
        parted = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(w))
        # the same greedy choices until then; the ranks' scoring pass (a prefill of the
        # forced tokens, other kernels and summation orders than the decode steps) may
        # itself see a near-tie there: 1.2e-4 nats at one position under numpy 2.4.6
        assert all(gap < 1e-3 for gap in row[:parted]), row
        assert parted == len(w) or row[parted] > 0  # parted on a near-tie


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"tensor_parallel_size": 3}, r"--tensor-parallel-size 3 must divide num_attention_heads"),
        ({"tensor_parallel_size": 4}, r"must divide num_key_value_heads \(2\)"),
        (
            {"tensor_parallel_size": 2, "quantization": "fp8"},
            r"FP8 weights with --tensor-parallel-size 2: model\.layers\.0\.self_attn\.qkv_proj "
            r"splits the output features of q_proj \(64\) into 32 per rank",
        ),
        (
            {
                "tensor_parallel_size": 2,
                "kv_transfer_config": {"kv_connector": "PdConnector", "kv_role": "kv_producer"},
            },
            r"--kv-transfer-config \(P/D\) with --tensor-parallel-size 2 is not supported",
        ),
        ({"data_parallel_size": 2}, r"--data-parallel-size 2 needs one engine-core process"),
        (
            {"tensor_parallel_size": 2, "data_parallel_size": 2},
            r"together with --data-parallel-size > 1 is not supported yet",
        ),
        ({"tensor_parallel_size": 0}, r"--tensor-parallel-size must be >= 1"),
    ],
)
def test_refused_before_any_rank_starts(
    tiny_llama: Path, extra: dict[str, Any], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[object] = []
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match=match):
        EngineCore(EngineConfig.from_kwargs(model=str(tiny_llama), **KW, **extra))
    assert not started


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (state first, then the parent pid)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    return [
        int(e)
        for e in os.listdir("/proc")
        if e.isdigit() and (_stat(int(e)) or ["", ""])[1] == str(pid)
    ]


def _gone(pid: int) -> bool:
    stat = _stat(pid)
    return stat is None or stat[0] in ("Z", "X")  # exited (a zombie nobody reaped yet)


@pytest.mark.parametrize("victim", ["follower", "leader"])
def test_a_dead_rank_fails_requests_and_stops_the_instance(tiny_llama: Path, victim: str) -> None:
    """Killing either rank mid-generation: the request ends with an error (the leader
    names the dead follower; a dead leader is the engine process dying) and every rank
    process exits, within a bounded time, never hanging."""
    config = EngineConfig.from_kwargs(model=str(tiny_llama), tensor_parallel_size=2, **KW)

    async def main() -> tuple[list[Any], float, int | None, int]:
        client = await AsyncEngineClient.start(config, log_level="WARNING", timeout=300)
        try:
            assert len(client._procs) == 1 and client._procs[0].pid is not None
            engine = client._procs[0]
            followers = _children(engine.pid)  # type: ignore[arg-type]
            assert len(followers) == 1
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            outs: list[Any] = []
            t0 = 0.0
            async with asyncio.timeout(120):
                async for out in client.generate("r", None, PROMPTS[0], params):
                    outs.append(out)
                    if len(outs) == 1:
                        os.kill(
                            followers[0] if victim == "follower" else engine.pid, signal.SIGKILL
                        )  # type: ignore[arg-type]
                        t0 = time.monotonic()
            waited = time.monotonic() - t0
            await asyncio.get_running_loop().run_in_executor(None, engine.join, 30)
            return outs, waited, engine.exitcode, followers[0]
        finally:
            await client.shutdown()

    outs, waited, exitcode, follower = asyncio.run(main())
    last = outs[-1]
    assert last.finished and last.outputs[0].finish_reason == "error"
    assert len(outs) < 400 and waited < 30
    if victim == "follower":
        assert "tensor-parallel rank 1" in (last.error or "") and "exited" in last.error
        assert exitcode == 1  # the engine core stopped after reporting it
    else:
        assert "engine process died" in (last.error or "") and exitcode == -signal.SIGKILL
    for _ in range(150):  # the follower leaves: a collective error, or its parent is gone
        if _gone(follower):
            break
        time.sleep(0.1)
    assert _gone(follower)


def test_each_rank_gets_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def tp(rank: int) -> RankInfo:
        return RankInfo(tp_size=2, tp_rank=rank)

    assert rank_device("cpu", tp(1)).type == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert rank_device("cuda", tp(1)) == torch.device("cuda", 1)
    assert rank_device("cuda:2", tp(1)) == torch.device("cuda", 3)
    with pytest.raises(ValueError, match=r"cuda:3..cuda:4 .* 4 GPU\(s\) are visible"):
        rank_device("cuda:3", tp(0))


def test_watchdog_ends_a_leader_stuck_with_a_dead_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL would wait for a dead peer until its timeout: the watchdog exits first."""

    class Exited:
        pid = 4242

        def poll(self) -> int:
            return -9

    leader = TPLeader.__new__(TPLeader)
    leader.grace_s, leader._dir, leader._procs = 0.3, str(tmp_path), [Exited()]  # type: ignore[list-item]
    leader._dead, leader._closed, leader._busy_since = None, False, time.monotonic()
    (tmp_path / "rank1.error").write_text("start-up failed: boom")
    exits: list[float] = []

    def fake_exit(code: int) -> None:
        exits.append(time.monotonic())
        leader._closed = True

    monkeypatch.setattr(os, "_exit", fake_exit)
    t0 = time.monotonic()
    leader._watch()  # returns once it "exited"
    assert exits and 0.3 <= exits[0] - t0 < 10
    assert (
        leader._dead
        == "tensor-parallel rank 1 (pid 4242) exited with code -9: start-up failed: boom"
    )
    with pytest.raises(RankFailure, match="rank 1 .* exited with code -9"):
        leader.check()


@pytest.mark.parametrize("how", ["generate_cli", "llm_left_to_exit"])
def test_a_clean_exit_logs_no_error_and_leaves_no_temp_dir(
    tiny_llama: Path, tmp_path: Path, how: str
) -> None:
    """`pdserve generate --tensor-parallel-size 2` (which shuts the engine down), and an
    LLM the script never shuts down (the engine's exit hook does): the follower leaves on
    the shutdown broadcast, so nothing logs an ERROR, and the temp dir is removed."""
    import subprocess
    import sys

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    if how == "generate_cli":
        args = ["-m", "pdserve", "generate", str(tiny_llama), "--prompt", "hi",
                "--max-tokens", "3", "--tensor-parallel-size", "2", "--dtype", "float32"]  # fmt: skip
    else:
        code = (
            "from pdserve import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny_llama)!r}, tensor_parallel_size=2, dtype='float32')\n"
            "print(llm.generate('hi', SamplingParams(max_tokens=3))[0].outputs[0].text)\n"
        )
        args = ["-c", code]
    done = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ERROR" not in done.stderr + done.stdout, done.stderr[-2000:]
    assert not list(tmp.glob("pdserve-tp-*"))
