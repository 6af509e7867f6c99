"""P/D between two in-process engine cores over the tcp transport (loopback)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from _drafters import OracleDrafter, WrongDrafter
from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.scheduler_output import EngineCoreOutput
from pdserve.engine.engine_core import EngineCore
from pdserve.frontend.processor import InputProcessor
from pdserve.frontend.tokenizer import Tokenizer

PROMPTS = [[(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((5, 16, 17, 33, 40))]


def _engine(path: Path, role: str, **extra: object) -> EngineCore:
    kvt = {
        "kv_connector": "PdConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "transport": "tcp",
            "handshake_timeout": 1.0,
            "transfer_timeout": 2.0,
            **extra.pop("extra", {}),
        },
    }  # type: ignore[dict-item]
    if "policy" in extra:
        kvt["kv_load_failure_policy"] = extra.pop("policy")
    cfg = EngineConfig.from_kwargs(
        model=str(path), dtype="float32", block_size=4, kv_transfer_config=kvt, **extra
    )
    return EngineCore(cfg)


def _proc(core: EngineCore, path: Path) -> InputProcessor:
    return InputProcessor(Tokenizer.from_pretrained(path), core.max_model_len, core.vocab_size)


def _run(
    core: EngineCore, until: set[str], limit: float = 20.0
) -> dict[str, list[EngineCoreOutput]]:
    got: dict[str, list[EngineCoreOutput]] = {}
    done: set[str] = set()
    deadline = time.monotonic() + limit
    while not until <= done:
        assert time.monotonic() < deadline, f"timed out waiting for {until - done}"
        for o in core.step():
            got.setdefault(o.request_id, []).append(o)
            if o.finish_reason is not None:
                done.add(o.request_id)
        if not core.has_schedulable_work():
            time.sleep(0.002)
    return got


def _prefill(p: EngineCore, pp: InputProcessor, rid: str, ids: list[int]) -> KVTransferParams:
    sp = SamplingParams(temperature=0, max_tokens=1)
    p.add_request(
        pp.make_request(rid, ids, sp, {"do_remote_decode": True, "do_remote_prefill": False})
    )
    out = _run(p, {rid})[rid][-1]
    assert out.finish_reason == "length" and out.kv_transfer_params is not None
    return out.kv_transfer_params


def _tokens(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _settle(*cores: EngineCore, timeout: float = 5.0) -> None:
    """Step until every core's KV is free again (delayed frees happen in steps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in cores:
            c.step()
        if all(c.kv.num_free_blocks == c.kv.pool.num_usable_blocks for c in cores):
            return
        time.sleep(0.01)
    raise AssertionError([c.kv.usage() for c in cores])


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    ]


@pytest.fixture(scope="module")
def pd(tiny_llama: Path):
    p = _engine(tiny_llama, "kv_producer", extra={"lease_seconds": 1.0})
    d = _engine(tiny_llama, "kv_consumer")
    yield p, d, _proc(p, tiny_llama), _proc(d, tiny_llama)
    p.shutdown()
    d.shutdown()


def test_transferred_kv_gives_identical_outputs(pd, reference) -> None:
    p, d, pp, dp = pd
    before = dict(d.stats().prompt_tokens_by_source)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        params = _prefill(p, pp, f"r{i}", ids)
        assert params.remote_request_id == f"r{i}" and params.do_remote_prefill is True
        assert len(params.remote_block_ids or []) == -(-len(ids) // 4)
        d.add_request(dp.make_request(f"r{i}", ids, sp, params))
    outs = _run(d, {f"r{i}" for i in range(len(PROMPTS))})
    assert [_tokens(outs[f"r{i}"]) for i in range(len(PROMPTS))] == reference
    after = d.stats().prompt_tokens_by_source
    # every prompt token but the last arrived over the wire; decode computed one per prompt
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == sum(
        len(x) - 1 for x in PROMPTS
    )
    assert after["local_compute"] - before["local_compute"] == len(PROMPTS)
    assert d.stats().kv_transfer_failures == 0
    _settle(p, d)  # prefill freed every held block once decode had read it
    assert p.stats().kv_leases_expired == 0


def test_lease_expires_when_decode_never_pulls(pd) -> None:
    p, d, pp, dp = pd
    expired = p.stats().kv_leases_expired
    _prefill(p, pp, "orphan", PROMPTS[3])
    assert p.kv.usage() > 0
    _settle(p, timeout=5.0)  # lease is 1 s
    assert p.stats().kv_leases_expired == expired + 1


def test_decode_abort_before_pull_frees_prefill_promptly(pd) -> None:
    p, d, pp, dp = pd
    params = _prefill(p, pp, "gone", PROMPTS[4])
    d.add_request(dp.make_request("gone", PROMPTS[4], SamplingParams(max_tokens=4), params))
    d.abort_requests(["gone"])
    t0 = time.monotonic()
    _settle(p, d, timeout=0.9)  # well inside the 1 s lease: freed by decode's notice
    assert time.monotonic() - t0 < 0.9


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_gone_before_transfer(tiny_llama: Path, reference, policy: str) -> None:
    p = _engine(tiny_llama, "kv_producer")
    d = _engine(tiny_llama, "kv_consumer", policy=policy)
    pp, dp = _proc(p, tiny_llama), _proc(d, tiny_llama)
    try:
        params = _prefill(p, pp, "x", PROMPTS[1])
        p.shutdown()  # the prefill instance dies holding the KV
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        d.add_request(dp.make_request("x", PROMPTS[1], sp, params))
        outs = _run(d, {"x"})["x"]
        if policy == "fail":
            assert outs[-1].finish_reason == "error"
            assert "KV transfer from prefill" in (outs[-1].error or "")
        else:
            assert outs[-1].finish_reason == "length"
            assert _tokens(outs) == reference[1]
        assert d.stats().kv_transfer_failures == 1
        _settle(d)
    finally:
        d.shutdown()


def test_incompatible_block_size_is_refused_naming_the_field(tiny_llama: Path) -> None:
    p = _engine(tiny_llama, "kv_producer")
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
    try:
        pp, dp = _proc(p, tiny_llama), _proc(d, tiny_llama)
        params = _prefill(p, pp, "m", PROMPTS[2])
        d.add_request(dp.make_request("m", PROMPTS[2], SamplingParams(max_tokens=2), params))
        out = _run(d, {"m"})["m"][-1]
        assert out.finish_reason == "error"
        assert "block_size (prefill 4, decode 8)" in (out.error or "")
        _settle(d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("drafter", [OracleDrafter, WrongDrafter])
def test_speculating_decode_instance_gives_identical_outputs(
    tiny_llama: Path, reference, drafter: type[OracleDrafter], async_scheduling: bool
) -> None:
    """1P1D with a drafter on the decode instance: its first step computes the last
    prompt token alone, later steps verify 1+k tokens; greedy output equals colocated."""
    seqs = {tuple(p): p + r for p, r in zip(PROMPTS, reference, strict=True)}
    p = _engine(tiny_llama, "kv_producer")
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
    pp, dp = _proc(p, tiny_llama), _proc(d, tiny_llama)
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, ids in enumerate(PROMPTS):
            d.add_request(dp.make_request(f"s{i}", ids, sp, _prefill(p, pp, f"s{i}", ids)))
        outs = _run(d, {f"s{i}" for i in range(len(PROMPTS))})
        assert [_tokens(outs[f"s{i}"]) for i in range(len(PROMPTS))] == reference
        st = d.stats()
        assert st.prompt_tokens_by_source["external_kv_transfer"] == sum(
            len(x) - 1 for x in PROMPTS
        )
        assert st.spec_num_drafts > 0
        assert (st.spec_num_accepted_tokens > 0) == (drafter is OracleDrafter)
        _settle(p, d)
    finally:
        p.shutdown()
        d.shutdown()
