"""Data parallelism through the API server's engine client, with gloo on the CPU: two
engine-core processes behind one client.

- DP=2 with expert parallelism on the tiny GLM-5 checkpoint (8 experts, 4 per rank):
  greedy outputs equal one process's, both ranks get work, the idle rank runs dummy
  forwards without stalling the busy one and without spinning while all are idle, and
  killing one rank ends the instance with a clear error.
- DP=2 on the tiny Llama checkpoint (independent replicas, no collectives): greedy
  outputs equal one process's; as a P/D prefill instance each rank's kv_transfer_params
  name that rank's own KV server, and a decode engine pulls from both.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _dp_client import GREEDY, ClientThread, prompts

from _pd_engines import engine, proc, run, tokens
from pdserve import LLM, SamplingParams
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.frontend.async_client import EngineDeadError

SMALL = dict(max_model_len=256, max_num_batched_tokens=64, num_gpu_blocks_override=256)


def _reference(path: Path, batch: list[list[int]]) -> list[list[int]]:
    """One process's greedy outputs (on one thread, as each rank here runs: on a shared
    2-core host two spinning threads make this tiny model ten times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(str(path), dtype="float32", block_size=4, **SMALL)  # type: ignore[arg-type]
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    finally:
        torch.set_num_threads(threads)
    return [o.outputs[0].token_ids for o in outs]


def test_offline_llm_refuses_data_parallel(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="one engine-core process per rank.*pdserve serve"):
        LLM(str(tiny_llama), dtype="float32", data_parallel_size=2)


@pytest.fixture(scope="module")
def glm_ep(tiny_glm5: Path) -> Iterator[ClientThread]:
    mtp = {"method": "mtp", "num_speculative_tokens": 2}  # idle ranks mirror the MTP passes
    c = ClientThread(
        tiny_glm5,
        data_parallel_size=2,
        enable_expert_parallel=True,
        speculative_config=mtp,
        **SMALL,  # type: ignore[arg-type]
    )
    yield c
    c.close()


def test_dp2_ep_matches_one_process(glm_ep: ClientThread, tiny_glm5: Path) -> None:
    client = glm_ep.client
    assert client.ready is not None and client.ready.lockstep
    assert [r.dp_rank for r in client.ready_ranks] == [0, 1]
    assert client.ready.num_blocks == 2 * 256
    batch = prompts(4)
    got = glm_ep.generate(batch)
    assert [toks for toks, _ in got] == _reference(tiny_glm5, batch)
    per_rank = client.rank_stats
    assert all(s.num_generated_tokens > 0 for s in per_rank)  # both ranks had requests
    merged = client.latest_stats()
    assert merged.num_generated_tokens == sum(s.num_generated_tokens for s in per_rank)


def test_idle_rank_runs_dummies_and_does_not_stall(glm_ep: ClientThread) -> None:
    client = glm_ep.client

    def snapshot() -> list[tuple[int, int, int]]:
        return [
            (s.num_generated_tokens, s.num_steps, s.step_paths.get("dummy:eager", 0))
            for s in client.rank_stats
        ]

    # The previous test's last steps (a dummy on the rank that finished first) may still
    # be on their way: start from snapshots that have stopped changing.
    before, settled_at, deadline = snapshot(), time.monotonic(), time.monotonic() + 10
    while time.monotonic() - settled_at < 0.5 and time.monotonic() < deadline:
        time.sleep(0.05)
        if (now := snapshot()) != before:
            before, settled_at = now, time.monotonic()
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    t0 = time.monotonic()
    [(toks, _)] = glm_ep.generate(prompts(1), sp, prefix="lone")
    assert len(toks) == 12 and time.monotonic() - t0 < 30
    owner = 0 if client.rank_stats[0].num_generated_tokens > before[0][0] else 1
    idle = 1 - owner

    def counts() -> tuple[int, int]:
        """(the owner's real steps, the idle rank's dummy forwards) since ``before``."""
        busy = client.rank_stats[owner].num_steps - before[owner][1]
        dummy = client.rank_stats[idle].step_paths.get("dummy:eager", 0) - before[idle][2]
        return busy, dummy

    deadline = time.monotonic() + 5  # the ranks' latest snapshots may still be on their way
    while counts()[0] != counts()[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    busy, dummy = counts()
    assert busy >= 2 and dummy == busy  # a dummy forward (with its MTP passes) per step
    assert client.rank_stats[owner].step_paths.get("dummy:eager", 0) == before[owner][2]
    # all idle: the ranks agree a few times a second, they do not spin
    time.sleep(0.5)
    agreed = [s.dp_step_agreements for s in client.rank_stats]
    time.sleep(1.0)
    now = [s.dp_step_agreements for s in client.rank_stats]
    assert all(0 < b - a <= 12 for a, b in zip(agreed, now, strict=True)), (agreed, now)


def test_killing_one_rank_stops_the_instance(glm_ep: ClientThread) -> None:
    """Last in this module: it ends the shared instance."""
    client = glm_ep.client
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    victim = client.process_ids[1]
    assert victim is not None

    async def kill_mid_request() -> tuple[list[int], str | None, str | None]:
        toks: list[int] = []
        killed: list[int] = []
        last = None
        async for out in client.generate("victim", None, prompts(2)[1], sp):
            toks += out.outputs[0].token_ids
            last = out
            if len(toks) >= 2 and not killed:
                killed.append(victim)
                os.kill(victim, signal.SIGKILL)
        assert last is not None
        return toks, last.outputs[0].finish_reason, last.error

    toks, reason, error = glm_ep.call(kill_mid_request(), timeout=60)
    assert reason == "error" and len(toks) < 200
    assert error is not None and "data-parallel rank 1 died" in error, error
    with pytest.raises(EngineDeadError, match="data-parallel rank"):
        glm_ep.call(client.check_health())
    with pytest.raises(EngineDeadError):
        glm_ep.call(client.generate("late", None, [5, 6], GREEDY).__anext__())


@pytest.fixture(scope="module")
def llama_dp(tiny_llama: Path) -> Iterator[ClientThread]:
    kvt = {
        "kv_connector": "PdConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"transport": "tcp", "handshake_timeout": 2.0},
    }
    c = ClientThread(tiny_llama, data_parallel_size=2, kv_transfer_config=kvt, **SMALL)
    yield c
    c.close()


def test_dp2_replicas_match_one_process(llama_dp: ClientThread, tiny_llama: Path) -> None:
    client = llama_dp.client
    assert client.ready is not None and not client.ready.lockstep
    batch = prompts(4)
    assert [t for t, _ in llama_dp.generate(batch)] == _reference(tiny_llama, batch)
    assert all(s.num_generated_tokens > 0 for s in client.rank_stats)
    assert all("dummy:eager" not in s.step_paths for s in client.rank_stats)


def test_pd_params_name_the_owning_rank(llama_dp: ClientThread, tiny_llama: Path) -> None:
    """Two prompts prefilled at once land on different ranks; each one's params name its
    own rank's KV server, and a decode engine pulls from both."""
    batch = prompts(3)[1:]
    kv = KVTransferParams(do_remote_decode=True, do_remote_prefill=False)
    pre = llama_dp.generate(batch, SamplingParams(temperature=0, max_tokens=1), "pd", kv)
    params = [out.kv_transfer_params for _, out in pre]
    assert all(p is not None for p in params)
    endpoints = {(p.remote_host, p.remote_port) for p in params if p is not None}
    assert len(endpoints) == 2  # one per rank
    d = engine(tiny_llama, "kv_consumer", **SMALL)
    try:
        dp = proc(d, tiny_llama)
        for i, (ids, p) in enumerate(zip(batch, params, strict=True)):
            d.add_request(dp.make_request(f"pd{i}", ids, GREEDY, p))
        outs = run(d, {"pd0", "pd1"})
        assert [tokens(outs[f"pd{i}"]) for i in range(2)] == _reference(tiny_llama, batch)
        assert d.stats().kv_transfer_failures == 0
    finally:
        d.shutdown()
