"""P/D between two in-process engine cores over the tcp transport (loopback)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from _drafters import OracleDrafter, WrongDrafter
from _pd_engines import PROMPTS, engine, handoff_error, prefill, proc, run, settle, tokens
from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    ]


@pytest.fixture(scope="module")
def pd(tiny_llama: Path):
    p = engine(tiny_llama, "kv_producer", extra={"lease_seconds": 1.0})
    d = engine(tiny_llama, "kv_consumer")
    yield p, d, proc(p, tiny_llama), proc(d, tiny_llama)
    p.shutdown()
    d.shutdown()


def test_transferred_kv_gives_identical_outputs(pd, reference) -> None:
    p, d, pp, dp = pd
    before = dict(d.stats().prompt_tokens_by_source)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        params = prefill(p, pp, f"r{i}", ids)
        assert params.remote_request_id == f"r{i}" and params.do_remote_prefill is True
        assert len(params.remote_block_ids or []) == -(-len(ids) // 4)
        d.add_request(dp.make_request(f"r{i}", ids, sp, params))
    outs = run(d, {f"r{i}" for i in range(len(PROMPTS))})
    assert [tokens(outs[f"r{i}"]) for i in range(len(PROMPTS))] == reference
    after = d.stats().prompt_tokens_by_source
    # every prompt token but the last arrived over the wire; decode computed one per prompt
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == sum(
        len(x) - 1 for x in PROMPTS
    )
    assert after["local_compute"] - before["local_compute"] == len(PROMPTS)
    assert d.stats().kv_transfer_failures == 0
    settle(p, d)  # prefill freed every held block once decode had read it
    assert p.stats().kv_leases_expired == 0


def test_lease_expires_when_decode_never_pulls(pd) -> None:
    p, d, pp, dp = pd
    expired = p.stats().kv_leases_expired
    prefill(p, pp, "orphan", PROMPTS[3])
    assert p.kv.usage() > 0
    settle(p, timeout=5.0)  # lease is 1 s
    assert p.stats().kv_leases_expired == expired + 1


def test_decode_abort_before_pull_frees_prefill_promptly(pd) -> None:
    p, d, pp, dp = pd
    params = prefill(p, pp, "gone", PROMPTS[4])
    d.add_request(dp.make_request("gone", PROMPTS[4], SamplingParams(max_tokens=4), params))
    d.abort_requests(["gone"])
    t0 = time.monotonic()
    settle(p, d, timeout=0.9)  # well inside the 1 s lease: freed by decode's notice
    assert time.monotonic() - t0 < 0.9


def test_params_of_one_prompt_never_pull_kv_for_another(pd) -> None:
    """Decode params of prompt X given with another prompt of the same block count: the
    prefill refuses the read (prompt digests differ) and the request fails without a
    token of X's continuation; X's own decode still reads the KV afterwards."""
    p, d, pp, dp = pd
    x = PROMPTS[3]
    other = [t + 1 for t in x]  # as long: the same block count
    params = prefill(p, pp, "x", x)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    d.add_request(dp.make_request("thief", other, sp, params))
    out = run(d, {"thief"})["thief"]
    assert out[-1].finish_reason == "error" and tokens(out) == []
    assert "another prompt" in (out[-1].error or "")
    for _ in range(20):  # the thief's give-up notice reaches prefill: it frees nothing
        d.step()
        p.step()
        time.sleep(0.01)
    assert p.stats().kv_held_for_remote_decode == 1
    d.add_request(dp.make_request("x", x, sp, params))  # the real decode of X
    out = run(d, {"x"})["x"]
    assert out[-1].finish_reason == "length" and len(tokens(out)) == 4
    settle(p, d)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_gone_before_transfer(tiny_llama: Path, reference, policy: str) -> None:
    p = engine(tiny_llama, "kv_producer")
    d = engine(tiny_llama, "kv_consumer", policy=policy)
    pp, dp = proc(p, tiny_llama), proc(d, tiny_llama)
    try:
        params = prefill(p, pp, "x", PROMPTS[1])
        p.shutdown()  # the prefill instance dies holding the KV
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        d.add_request(dp.make_request("x", PROMPTS[1], sp, params))
        outs = run(d, {"x"})["x"]
        if policy == "fail":
            assert outs[-1].finish_reason == "error"
            assert "KV transfer from prefill" in (outs[-1].error or "")
        else:
            assert outs[-1].finish_reason == "length"
            assert tokens(outs) == reference[1]
        assert d.stats().kv_transfer_failures == 1
        settle(d)
    finally:
        d.shutdown()


def test_incompatible_block_size_is_refused_naming_the_field(tiny_llama: Path) -> None:
    p = engine(tiny_llama, "kv_producer")
    cfg = EngineConfig.from_kwargs(
        model=str(tiny_llama),
        dtype="float32",
        block_size=8,
        kv_transfer_config={
            "kv_connector": "PdConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"handshake_timeout": 1.0},
        },
    )
    d = EngineCore(cfg)
    assert "block_size (prefill 4, decode 8)" in handoff_error(p, d, tiny_llama)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("drafter", [OracleDrafter, WrongDrafter])
def test_speculating_decode_instance_gives_identical_outputs(
    tiny_llama: Path, reference, drafter: type[OracleDrafter], async_scheduling: bool
) -> None:
    """1P1D with a drafter on the decode instance: its first step computes the last
    prompt token alone, later steps verify 1+k tokens; greedy output equals colocated."""
    seqs = {tuple(p): p + r for p, r in zip(PROMPTS, reference, strict=True)}
    p = engine(tiny_llama, "kv_producer")
    cfg = EngineConfig.from_kwargs(
        model=str(tiny_llama),
        dtype="float32",
        block_size=4,
        async_scheduling=async_scheduling,
        kv_transfer_config={
            "kv_connector": "PdConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"transport": "tcp", "handshake_timeout": 1.0},
        },
    )
    d = EngineCore(cfg, drafter(3, seqs, 512))
    pp, dp = proc(p, tiny_llama), proc(d, tiny_llama)
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, ids in enumerate(PROMPTS):
            d.add_request(dp.make_request(f"s{i}", ids, sp, prefill(p, pp, f"s{i}", ids)))
        outs = run(d, {f"s{i}" for i in range(len(PROMPTS))})
        assert [tokens(outs[f"s{i}"]) for i in range(len(PROMPTS))] == reference
        st = d.stats()
        assert st.prompt_tokens_by_source["external_kv_transfer"] == sum(
            len(x) - 1 for x in PROMPTS
        )
        assert st.spec_num_drafts > 0
        assert (st.spec_num_accepted_tokens > 0) == (drafter is OracleDrafter)
        settle(p, d)
    finally:
        p.shutdown()
        d.shutdown()
