"""A model with two cache groups of different dtype and layout (tests/_two_group_model.py:
float K/V at block axis 1 plus uint8 codes at block axis 0) keeps both groups bit-exact
through prefix caching and through P/D transfer (tcp on CPU; cuda_ipc on a GPU)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from _two_group_model import ARCH, register
from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.core_types.scheduler_output import EngineCoreOutput
from pdserve.engine.engine_core import EngineCore
from pdserve.frontend.processor import InputProcessor
from pdserve.frontend.tokenizer import Tokenizer
from pdserve.kv_transfer.transports.tcp import TcpClient

PROMPTS = [[(11 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((6, 17, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def two_group(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("two-group")
    shutil.copytree(tiny_llama, d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = [ARCH]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.MonkeyPatch.context() as mp:
        register(mp)
        yield d


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_layers_declare_two_groups(two_group: Path) -> None:
    llm = LLM(str(two_group), dtype="float32", block_size=4)
    cfg = llm.engine.runner.kv_cache_config
    groups = {g.name: g for g in cfg.groups}
    assert set(groups) == {"attn", "codes"}
    assert groups["attn"].layout.dtype == "float32" and groups["attn"].layout.block_axis == 1
    assert groups["codes"].layout.dtype == "uint8" and groups["codes"].layout.block_axis == 0
    assert groups["codes"].layer_names == ("codes.0", "codes.1")
    assert cfg.bytes_per_block == 2 * (2 * 4 * 2 * 16 * 4) + 2 * (4 * 4)
    kv = llm.engine.runner.kv_caches
    assert kv["codes.1"].dtype == torch.uint8 and kv["codes.1"].shape[0] == kv.num_blocks


def test_codes_change_the_output(tiny_llama: Path, two_group: Path) -> None:
    """The second group matters: the model's tokens differ from the plain Llama's."""
    plain = _tokens(LLM(str(tiny_llama), dtype="float32", block_size=4), PROMPTS)
    assert _tokens(LLM(str(two_group), dtype="float32", block_size=4), PROMPTS) != plain


def test_prefix_cache_reuses_both_groups(two_group: Path) -> None:
    cold = _tokens(
        LLM(str(two_group), dtype="float32", block_size=4, enable_prefix_caching=False), PROMPTS
    )
    llm = LLM(str(two_group), dtype="float32", block_size=4)
    assert _tokens(llm, PROMPTS) == cold
    hits = llm.engine.stats().prefix_cache_hits
    assert _tokens(llm, PROMPTS) == cold  # block-aligned hits on every prompt
    # a prompt sharing 2.5 blocks of another: the hit stops at the block boundary
    shared = PROMPTS[2][:10] + [7, 8, 9, 10, 11]
    ref = _tokens(
        LLM(str(two_group), dtype="float32", block_size=4, enable_prefix_caching=False), [shared]
    )
    assert _tokens(llm, [shared]) == ref
    assert llm.engine.stats().prefix_cache_hits > hits


def _pd_engine(path: Path, role: str, transport: str, device: str) -> EngineCore:
    cfg = EngineConfig.from_kwargs(
        model=str(path),
        dtype="float32",
        block_size=4,
        device=device,
        enforce_eager=True,
        kv_transfer_config={
            "kv_connector": "PdConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"transport": transport, "handshake_timeout": 2.0},
        },
    )
    return EngineCore(cfg)


def _finish(core: EngineCore, rid: str, limit: float = 20.0) -> tuple[list[int], EngineCoreOutput]:
    toks: list[int] = []
    deadline = time.monotonic() + limit
    while True:
        assert time.monotonic() < deadline, f"{rid} did not finish"
        for o in core.step():
            if o.request_id == rid:
                toks.extend(o.new_token_ids)
                if o.finish_reason is not None:
                    return toks, o
        time.sleep(0.001)


def _blocks(c: torch.Tensor, axis: int, ids: list[int]) -> torch.Tensor:
    return c.index_select(axis, torch.tensor(ids, device=c.device))


def _spy_on_writes(cls: type, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int]]]:
    """Record (remote ids, local ids) of every block copy a transport client makes. The
    connector starts each copy with ``begin_write`` (cuda_ipc overrides it; tcp's default
    calls ``write``), so that is where the spy sits."""
    copies: list[tuple[list[int], list[int]]] = []
    real = cls.begin_write

    def spy(self, remote, local, frames, *rest, **kw):  # type: ignore[no-untyped-def]
        copies.append((list(remote), list(local)))
        return real(self, remote, local, frames, *rest, **kw)

    monkeypatch.setattr(cls, "begin_write", spy)
    return copies


def _same_blocks(want: dict[str, torch.Tensor], d: EngineCore, local: list[int], full: int) -> None:
    """Every full block of transferred tokens (all but the prompt's last token) holds the
    prefill's bytes, in both groups (``want``: prefill's held blocks, by layer)."""
    assert full > 0
    for name, lay, dc in d.runner.kv_caches.layers():
        ax = lay.block_axis
        a = want[name].narrow(ax, 0, full).to(dc.device)
        b = _blocks(dc, ax, local[:full])
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_tcp_transfer_moves_both_groups_bit_exactly(
    two_group: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    colocated = _tokens(LLM(str(two_group), dtype="float32", block_size=4), PROMPTS)
    copies = _spy_on_writes(TcpClient, monkeypatch)
    p = _pd_engine(two_group, "kv_producer", "tcp", "cpu")
    d = _pd_engine(two_group, "kv_consumer", "tcp", "cpu")
    tok = Tokenizer.from_pretrained(two_group)
    pp = InputProcessor(tok, p.max_model_len, p.vocab_size)
    dp = InputProcessor(tok, d.max_model_len, d.vocab_size)
    got = []
    try:
        for i, ids in enumerate(PROMPTS):
            rid = f"r{i}"
            one = SamplingParams(temperature=0, max_tokens=1)
            p.add_request(pp.make_request(rid, ids, one, {"do_remote_decode": True}))
            params = _finish(p, rid)[1].kv_transfer_params
            assert params is not None and params.do_remote_prefill
            held = torch.tensor(params.remote_block_ids or [])
            want = {
                n: c.index_select(lay.block_axis, held) for n, lay, c in p.runner.kv_caches.layers()
            }
            d.add_request(dp.make_request(rid, ids, GREEDY, params))
            got.append(_finish(d, rid)[0])
            assert len(copies) == 1
            _same_blocks(want, d, copies.pop()[1], (len(ids) - 1) // 4)
    finally:
        p.shutdown()
        d.shutdown()
    assert got == colocated


@pytest.mark.gpu
def test_cuda_ipc_transfer_moves_both_groups_bit_exactly(
    two_group: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill engine runs in a child process (CUDA opens no IPC handle in the
    process that exported it); it sends back each prompt's params and held blocks."""
    import multiprocessing as mp

    from _ipc_peer import prefill_engine
    from pdserve.kv_transfer.transports.cuda_ipc import CudaIpcClient

    colocated = _tokens(LLM(str(two_group), dtype="float32", block_size=4, device="cuda"), PROMPTS)
    copies = _spy_on_writes(CudaIpcClient, monkeypatch)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_engine, args=(two_group, PROMPTS, child))
    proc.start()
    d = _pd_engine(two_group, "kv_consumer", "cuda_ipc", "cuda")
    dp = InputProcessor(Tokenizer.from_pretrained(two_group), d.max_model_len, d.vocab_size)
    got = []
    try:
        assert parent.poll(300), "the prefill process did not answer"
        for i, (params, want) in enumerate(parent.recv()):
            d.add_request(dp.make_request(f"r{i}", PROMPTS[i], GREEDY, params))
            got.append(_finish(d, f"r{i}")[0])
            assert len(copies) == 1
            _same_blocks(want, d, copies.pop()[1], (len(PROMPTS[i]) - 1) // 4)
    finally:
        parent.send("stop")
        proc.join(60)
        d.shutdown()
    assert got == colocated
