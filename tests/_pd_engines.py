"""In-process P/D engines for the kv_transfer tests (imported by name: pytest puts
``tests/`` on the path for its root conftest)."""

from __future__ import annotations

import time
from pathlib import Path

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.scheduler_output import EngineCoreOutput
from pdserve.engine.engine_core import EngineCore
from pdserve.frontend.processor import InputProcessor
from pdserve.frontend.tokenizer import Tokenizer

PROMPTS = [[(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((5, 16, 17, 33, 40))]


def engine(path: Path, role: str, **extra: object) -> EngineCore:
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


def proc(core: EngineCore, path: Path) -> InputProcessor:
    return InputProcessor(Tokenizer.from_pretrained(path), core.max_model_len, core.vocab_size)


def run(
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


def prefill(p: EngineCore, pp: InputProcessor, rid: str, ids: list[int]) -> KVTransferParams:
    sp = SamplingParams(temperature=0, max_tokens=1)
    p.add_request(
        pp.make_request(rid, ids, sp, {"do_remote_decode": True, "do_remote_prefill": False})
    )
    out = run(p, {rid})[rid][-1]
    assert out.finish_reason == "length" and out.kv_transfer_params is not None
    return out.kv_transfer_params


def tokens(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def settle(*cores: EngineCore, timeout: float = 5.0) -> None:
    """Step until every core's KV is free again (delayed frees happen in steps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in cores:
            c.step()
        if all(c.kv.num_free_blocks == c.kv.pool.num_usable_blocks for c in cores):
            return
        time.sleep(0.01)
    raise AssertionError([c.kv.usage() for c in cores])


def handoff_error(p: EngineCore, d: EngineCore, path: Path) -> str:
    """The error the decode instance ``d`` reports for one request prefilled on ``p``
    (the pair is expected to refuse the hand-off); both are shut down."""
    try:
        pp, dp = proc(p, path), proc(d, path)
        params = prefill(p, pp, "m", PROMPTS[2])
        d.add_request(dp.make_request("m", PROMPTS[2], SamplingParams(max_tokens=2), params))
        out = run(d, {"m"})["m"][-1]
        assert out.finish_reason == "error"
        settle(d)
        return out.error or ""
    finally:
        p.shutdown()
        d.shutdown()
