"""Async scheduling (one step in flight) gives exactly the outputs of the synchronous engine.

The host schedules step N+1 before step N's tokens are known: the scheduler counts them
as placeholders and the runner feeds them to step N+1 from the device. These tests run
both engines on the same requests, through the paths where that bookkeeping matters:
chunked prefill, prefix-cache hits, preemption, every kind of stop, seeded sampling,
min_tokens, aborts, and requests that arrive while a step is in flight.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from _requests import assert_clean, outputs, random_prompts

from pdserve import LLM, SamplingParams
from pdserve.engine.request import Request


def _pair(path: Path, **kw: object) -> tuple[LLM, LLM]:
    base = dict(dtype="float32", block_size=4)
    base.update(kw)
    sync = LLM(str(path), async_scheduling=False, **base)  # type: ignore[arg-type]
    return sync, LLM(str(path), async_scheduling=True, **base)  # type: ignore[arg-type]


def test_greedy_chunked_prefix_cached_and_preempted(tiny_llama: Path) -> None:
    sync, asyn = _pair(tiny_llama, max_num_batched_tokens=16)
    prompts = random_prompts(sync.engine.vocab_size)
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        for m in (24, 1, 7, 30, 2, 12, 5)
    ]
    want = outputs(sync, prompts, params)
    assert outputs(asyn, prompts, params) == want
    assert outputs(asyn, prompts, params) == want  # again, through the prefix cache
    assert asyn.engine.stats().prefix_cache_hits > 0
    assert_clean(asyn)
    small_sync, small_async = _pair(
        tiny_llama, num_gpu_blocks_override=20, enable_prefix_caching=False
    )
    want = outputs(small_sync, prompts, params)
    assert outputs(small_async, prompts, params) == want
    assert small_async.engine.stats().num_preemptions > 0
    assert_clean(small_async)


def test_stops_seeds_min_tokens_and_logprobs(tiny_llama: Path) -> None:
    sync, asyn = _pair(tiny_llama)
    prompts = random_prompts(sync.engine.vocab_size, (5, 12, 20, 8, 30, 15), seed=1)
    free = outputs(sync, prompts, [SamplingParams(temperature=0.0, max_tokens=20)] * 6)
    stop_tok = free[0][0][3]  # a token the first request produces: it stops there
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0.0, max_tokens=20),  # may stop on EOS
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3, max_tokens=16),
        SamplingParams(temperature=1.0, min_p=0.05, seed=4, max_tokens=9, min_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.7, seed=5, max_tokens=11, min_tokens=4),
    ]
    want = outputs(sync, prompts, params)
    got = outputs(asyn, prompts, params)
    assert got == want
    assert want[0][1] == "stop" and want[0][2] == stop_tok
    lp_sync = sync.generate({"prompt_token_ids": prompts[4]}, params[4])[0].outputs[0].logprobs
    lp_async = asyn.generate({"prompt_token_ids": prompts[4]}, params[4])[0].outputs[0].logprobs
    assert lp_sync is not None and lp_async is not None
    torch.testing.assert_close(torch.tensor(lp_async), torch.tensor(lp_sync))
    assert_clean(asyn)


def test_arrivals_and_aborts_while_a_step_is_in_flight(tiny_llama: Path) -> None:
    sync, asyn = _pair(tiny_llama)
    prompts = random_prompts(sync.engine.vocab_size, (6, 14, 22, 9), seed=2)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def drive(llm: LLM) -> dict[str, list[int]]:
        eng = llm.engine
        got: dict[str, list[int]] = {}
        for i, p in enumerate(prompts[:2]):
            eng.add_request(llm.processor.make_request(f"r{i}", p, sp))
        steps = 0
        while eng.has_unfinished_requests() or steps < 3:
            for out in eng.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            steps += 1
            if steps == 3:  # mid-decode: two more arrive, one running request is aborted
                for i in (2, 3):
                    eng.add_request(llm.processor.make_request(f"r{i}", prompts[i], sp))
                eng.abort_requests(["r1"])
        got.pop("r1", None)
        return got

    want = drive(sync)
    assert drive(asyn) == want
    assert all(len(v) == 10 for v in want.values()) and set(want) == {"r0", "r2", "r3"}
    assert_clean(asyn)


def test_no_request_objects_leak(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", async_scheduling=True)
    prompts = random_prompts(llm.engine.vocab_size, (4, 9, 13) * 20, seed=3)
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    )
    assert_clean(llm)
    gc.collect()
    assert sum(1 for o in gc.get_objects() if isinstance(o, Request)) == 0


@pytest.mark.parametrize("flag", ["--async-scheduling", "--no-async-scheduling"])
def test_serve_flag_reaches_the_engine_config(flag: str) -> None:
    import argparse

    from pdserve.config import EngineConfig, add_engine_args

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    args = ap.parse_args(["m", flag])
    cfg = EngineConfig.from_cli(args)
    assert cfg.scheduler.async_scheduling is (flag == "--async-scheduling")


def test_step_n_plus_1_is_launched_before_step_n_is_finished(tiny_llama: Path) -> None:
    """Depth 1: step N lands in step N+1's land phase, after N+1's forward is enqueued."""
    llm = LLM(str(tiny_llama), dtype="float32", async_scheduling=True)
    pipe = llm.engine.pipeline
    calls: list[tuple[str, int]] = []
    launch, finish, forward = pipe.launch, pipe.finish, pipe.forward
    handles: dict[int, int] = {}
    alive = []  # the handles, so that no id is reused

    def spy_launch(*a):  # type: ignore[no-untyped-def]
        h = launch(*a)
        handles[id(h)] = len(handles)
        alive.append(h)
        return h

    def spy_forward(*a):  # type: ignore[no-untyped-def]
        calls.append(("forward", len(handles)))
        return forward(*a)

    def spy_finish(h):  # type: ignore[no-untyped-def]
        calls.append(("finish", handles[id(h)]))
        return finish(h)

    pipe.launch, pipe.finish = spy_launch, spy_finish  # type: ignore[method-assign]
    pipe.forward = spy_forward  # type: ignore[method-assign]
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert calls[:5] == [
        ("forward", 0),
        ("forward", 1),
        ("finish", 0),
        ("forward", 2),
        ("finish", 1),
    ]


def test_switching_modes_mid_generation_keeps_outputs(tiny_llama: Path) -> None:
    sync, _ = _pair(tiny_llama)
    prompts = random_prompts(sync.engine.vocab_size, (7, 19), seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = outputs(sync, prompts, [sp, sp])
    eng = sync.engine
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        eng.add_request(sync.processor.make_request(f"s{i}", p, sp))
    for n in range(100):
        if n in (2, 6):
            eng.set_async_scheduling(True)
        outs = eng.set_async_scheduling(False) if n in (4, 9) else []
        outs += eng.step()
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not eng.has_unfinished_requests():
            break
    assert [got["s0"], got["s1"]] == [w[0] for w in want]
    assert_clean(sync)
