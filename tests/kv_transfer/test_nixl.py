"""The nixl transport: its protocol against a fake agent (tests/_fake_nixl.py: the
subset of nixl_agent it calls, over host memory), and 1P1D greedy equality through
two engines, with the fake agent and, where a NIXL package is installed and its UCX
host-memory path works, with the real one."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from _fake_nixl import FakeFabric
from _ipc_peer import filled_caches
from _kv_side_channel import COMPAT
from _pd_engines import PROMPTS, engine, prefill, proc, run, settle, tokens
from _polling import wait_until
from pdserve import LLM, SamplingParams
from pdserve.config.kv_transfer import DEFAULT_NIXL_THREADS
from pdserve.core_types.cache_spec import CacheLayout, KVCacheConfig
from pdserve.core_types.kv_connector import KVLoad, KVNotice, KVPeer
from pdserve.core_types.pd_auth import new_secret
from pdserve.forward_context import KVCaches
from pdserve.kv_transfer.handler import KVRequestHandler, ServerLimits
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.puller import KVPuller, LoadResult
from pdserve.kv_transfer.server import KVServer
from pdserve.kv_transfer.transports import nixl as N
from pdserve.kv_transfer.transports import open_transport
from pdserve.kv_transfer.transports.block_copy import Segments

SECRET = new_secret().encode()
NUM_BLOCKS = 12


def filled(cfg: KVCacheConfig, num_blocks: int, seed: int | None) -> KVCaches:
    if seed is None:
        return KVCaches.allocate(cfg, num_blocks, torch.device("cpu"))
    return filled_caches(cfg, num_blocks, "cpu", seed)


def _config() -> KVCacheConfig:
    """Two groups: K/V (block axis 1: two segments a layer) and uint8 codes (axis 0)."""
    gqa = CacheLayout("gqa", "float32", (2, 1, 4, 2, 8), block_axis=1)
    codes = CacheLayout("codes", "uint8", (1, 4, 3), block_axis=0)
    return KVCacheConfig.from_layers(
        4, [("l0.attn", "attn", gqa), ("l0.codes", "codes", codes), ("l1.attn", "attn", gqa)]
    )


def test_runs_of_consecutive_blocks_become_one_descriptor_per_segment() -> None:
    src, dst = filled(_config(), NUM_BLOCKS, 0), filled(_config(), NUM_BLOCKS, None)
    rs, ls = Segments.of(src), Segments.of(dst)
    assert len(rs.addrs) == 5  # 2 + 1 + 2
    remote, local = N.read_descriptors(rs, ls, [7, 8, 9, 2], [1, 2, 3, 6], 0, 0)
    assert remote.shape == local.shape == (2 * 5, 3)  # two runs x five segments
    kv = src["l0.attn"]
    bb = 4 * 2 * 8 * 4  # bytes of one block in one half (K or V)
    assert remote[0].tolist() == [kv.data_ptr() + 7 * bb, 3 * bb, 0]
    assert remote[1].tolist() == [kv.data_ptr() + NUM_BLOCKS * bb + 7 * bb, 3 * bb, 0]
    assert local[5].tolist() == [dst["l0.attn"].data_ptr() + 6 * bb, bb, 0]
    assert remote[4, 1] == 3 * 12  # the codes group comes last: 12 bytes a block


class _Pair:
    """A prefill KV server and a decode puller on nixl over one fake fabric."""

    def __init__(self, fabric: FakeFabric, leases: LeaseTable, transfer_timeout: float) -> None:
        self.src = filled(_config(), NUM_BLOCKS, 0)
        self.dst = filled(_config(), NUM_BLOCKS, None)
        self.p_ep = N.NixlEndpoint(self.src, agent_api=fabric.api())
        self.d_ep = N.NixlEndpoint(self.dst, agent_api=fabric.api())
        handler = KVRequestHandler(
            SECRET, "prefill-0", COMPAT, N.NixlServer(self.src, self.p_ep), leases, ServerLimits()
        )
        self.server = KVServer(handler, "127.0.0.1", 0)
        self.puller = KVPuller(
            COMPAT,
            lambda info: N.NixlClient(self.dst, info, self.d_ep),
            2.0,
            transfer_timeout,
            SECRET,
        )
        self.results: dict[str, LoadResult] = {}

    def load(self, rid: str, remote: str, local: list[int], held: list[int]) -> None:
        self.puller.load(
            KVLoad(rid, KVPeer("127.0.0.1", self.server.port), remote, local, 0, len(held))
        )

    def wait(self, rids: set[str]) -> dict[str, LoadResult]:
        def done() -> bool:
            self.results.update({r.request_id: r for r in self.puller.take_results()})
            return rids <= set(self.results)

        assert wait_until(done, 10.0, 0.005)
        return self.results

    def close(self) -> None:
        self.puller.close()
        self.server.close()
        self.p_ep.close()
        self.d_ep.close()


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[_Pair, FakeFabric, LeaseTable]]:
    fail, timeout = getattr(request, "param", (None, 5.0))
    fabric = FakeFabric(fail)
    leases = LeaseTable(30.0)
    p = _Pair(fabric, leases, timeout)
    yield p, fabric, leases
    p.close()


def _blocks(c: torch.Tensor, axis: int, ids: list[int]) -> torch.Tensor:
    return c.index_select(axis, torch.tensor(ids))


def test_reads_move_every_group_register_once_and_release_the_lease(pair) -> None:
    p, fabric, leases = pair
    real_finish = leases.finish

    def finish(rid: str, *args: str | None) -> bool:
        fabric.log("prefill", f"done {rid}")
        return real_finish(rid, *args)

    leases.finish = finish  # type: ignore[method-assign]
    held = {"a": [5, 6, 7, 1], "b": [9, 10]}
    local = {"a": [0, 1, 2, 3], "b": [8, 4]}
    for rid in held:
        leases.add(rid, held[rid])
        p.load(rid, rid, local[rid], held[rid])
    res = p.wait({"a", "b"})
    assert all(r.error is None for r in res.values()), res
    assert res["a"].nbytes == 4 * _config().bytes_per_block
    for rid in held:
        for (_, lay, s), (_, _, d) in zip(p.src.layers(), p.dst.layers(), strict=True):
            want = _blocks(s, lay.block_axis, held[rid])
            assert torch.equal(_blocks(d, lay.block_axis, local[rid]), want)
    done: list[str] = []
    assert wait_until(lambda: sorted(done.__iadd__(leases.take_done())) == ["a", "b"], 2.0)
    # registration once per agent, the prefill metadata loaded once, one READ per load
    assert fabric.count("register_memory") == 2
    assert fabric.count("add_remote_agent") == 1
    assert p.p_ep.name in fabric.agents[p.d_ep.name].remotes
    assert fabric.count("initialize_xfer") == fabric.count("release_xfer_handle") == 2
    # each done notice reached prefill only after its READ had completed
    order = [w for _, w in fabric.calls if w in ("read_complete", "done a", "done b")]
    assert order == ["read_complete", "done a", "read_complete", "done b"]


def test_heartbeats_go_out_while_a_read_is_landing(pair) -> None:
    """The side channel is idle while a READ lands: the peer's queued notices use it."""
    p, fabric, leases = pair
    real_renew = leases.renew

    def renew(ids: list[str]) -> None:
        fabric.log("prefill", "renew")
        real_renew(ids)

    leases.renew = renew  # type: ignore[method-assign]
    leases.add("a", [3, 4])
    fabric.gate.clear()
    p.load("a", "a", [1, 2], [3, 4])
    assert wait_until(lambda: fabric.count("transfer") == 1, 5.0)
    p.puller.heartbeat(KVNotice(KVPeer("127.0.0.1", p.server.port), ["a"]))
    assert wait_until(lambda: fabric.count("renew") == 1, 5.0)
    fabric.gate.set()
    assert p.wait({"a"})["a"].error is None
    order = [w for _, w in fabric.calls if w in ("renew", "read_complete")]
    assert order == ["renew", "read_complete"]


@pytest.mark.parametrize(
    ("pair", "why"),
    [
        (("transfer", 5.0), "failed (ERR)"),
        (("post", 5.0), "could not be posted"),
        (("stuck", 0.3), "did not complete in"),
    ],
    indirect=["pair"],
)
def test_a_failed_read_is_a_transfer_error_and_sends_no_done(pair, why: str) -> None:
    p, fabric, leases = pair
    leases.add("a", [3, 4])
    p.load("a", "a", [1, 2], [3, 4])
    err = p.wait({"a"})["a"].error or ""
    assert "KV transfer from prefill" in err and "NIXL READ" in err and why in err
    assert fabric.count("release_xfer_handle") == 1  # the request was released (cancelled)
    assert leases.take_done() == [] and len(leases) == 1  # held until decode gives it up
    assert not p.dst["l0.attn"].any()


def test_the_endpoint_turns_cuda_ipc_gets_on_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode READs are UCX GETs, which cuda_ipc turns off without an active NVLink (then
    emulated over TCP loopback): the endpoint sets UCX_CUDA_IPC_ENABLE_GET_ZCOPY before
    its agent's UCX context is made, and leaves a value the environment chose."""
    import os

    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    seen: list[str | None] = []

    class Agent:
        def __init__(self, name: str, config: object) -> None:
            seen.append(os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY"))
            raise RuntimeError("stop here")

    class Config:
        def __init__(self, backends: list[str]) -> None:
            pass

    caches = filled(_config(), NUM_BLOCKS, None)
    for preset in (None, "off"):
        if preset:
            monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", preset)
        with pytest.raises(RuntimeError, match="stop here"):
            N.NixlEndpoint(caches, agent_api=(Agent, Config))
    assert seen == ["on", "off"]


def test_nixl_threads_reach_the_ucx_backend() -> None:
    """``nixl_threads`` (kv_connector_extra_config) makes the UCX backend NIXL's thread
    pool (``num_threads``) with a split threshold low enough that a READ's descriptors
    are spread over the threads; 0 leaves NIXL's single-worker backend (made by the
    agent's config, no parameters)."""
    got: list[tuple[str, object]] = []

    class Agent:
        def __init__(self, name: str, config: object) -> None:
            got.append(("config", config.kwargs))  # type: ignore[attr-defined]

        def create_backend(self, backend: str, params: dict[str, str]) -> None:
            got.append((backend, params))
            raise RuntimeError("stop here")

        def register_memory(self, tensors: object) -> None:
            raise RuntimeError("stop here")

    class Config:
        def __init__(self, **kwargs: object) -> None:
            self.kwargs = kwargs

    caches = filled(_config(), NUM_BLOCKS, None)
    for n in (0, 4):
        with pytest.raises(RuntimeError, match="stop here"):
            N.NixlEndpoint(caches, agent_api=(Agent, Config), num_threads=n)
    split = str(N._SPLIT_DESCS)
    assert got == [
        ("config", {"backends": ["UCX"]}),
        ("config", {"backends": []}),
        ("UCX", {"num_threads": "4", "split_batch_size": split}),
    ]
    assert 1 < N._SPLIT_DESCS < 64  # a 1K llama-8b-shape read (64 descriptors) splits


def test_without_a_nixl_package_the_transport_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in ("nixl", "nixl._api", "nixl_cu13", "nixl_cu13._api", "nixl_cu12", "nixl_cu12._api"):
        monkeypatch.setitem(sys.modules, mod, None)  # import fails
    with pytest.raises(RuntimeError, match=r"pip install nixl-cu1[23].*nixl-cu13 for CUDA 13"):
        open_transport("nixl", filled(_config(), NUM_BLOCKS, None))


def _real_nixl_skip_reason() -> str | None:
    """Why the real NIXL cannot run here, or None: a package must import and its UCX
    backend must complete a host-memory READ between two agents."""
    try:
        agent_cls, config_cls = N.load_nixl()
    except RuntimeError as e:
        return f"no NIXL package installed ({e})"
    try:
        src = torch.arange(64, dtype=torch.float32)
        dst = torch.zeros(64)
        a = agent_cls("pdserve-probe-a", config_cls(backends=["UCX"]))
        b = agent_cls("pdserve-probe-b", config_cls(backends=["UCX"]))
        if "UCX" not in getattr(a, "backends", {"UCX": 1}):
            return "NIXL has no UCX backend here"
        a.register_memory([src])
        b.register_memory([dst])
        name = b.add_remote_agent(a.get_agent_metadata())
        rd = np.array([[src.data_ptr(), 256, 0]], dtype=np.uint64)
        ld = np.array([[dst.data_ptr(), 256, 0]], dtype=np.uint64)
        h = b.initialize_xfer(
            "READ", b.get_xfer_descs(ld, "DRAM"), b.get_xfer_descs(rd, "DRAM"), name
        )
        state = b.transfer(h)
        for _ in range(100000):
            if state != "PROC":
                break
            state = b.check_xfer_state(h)
        b.release_xfer_handle(h)
        if state != "DONE" or not torch.equal(src, dst):
            return f"NIXL's UCX host-memory READ did not complete here ({state})"
    except Exception as e:
        return f"NIXL's UCX host-memory path does not run here: {type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    ]


def _pd(tiny_llama: Path):  # type: ignore[no-untyped-def]
    p = engine(tiny_llama, "kv_producer", extra={"transport": "nixl"})
    d = engine(tiny_llama, "kv_consumer", extra={"transport": "nixl"})
    return p, d, proc(p, tiny_llama), proc(d, tiny_llama)


@pytest.fixture(scope="module")
def fake_pd(tiny_llama: Path):  # type: ignore[no-untyped-def]
    """A prefill and a decode engine on nixl over one fake fabric (shared by two tests)."""
    fabric = FakeFabric()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(N, "load_nixl", fabric.api)
        p, d, pp, dp = _pd(tiny_llama)
    yield fabric, p, d, pp, dp
    p.shutdown()
    d.shutdown()


def _identical_outputs(p, d, pp, dp, reference) -> None:  # type: ignore[no-untyped-def]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = d.stats().prompt_tokens_by_source["external_kv_transfer"]
    for i, ids in enumerate(PROMPTS):
        d.add_request(dp.make_request(f"r{i}", ids, sp, prefill(p, pp, f"r{i}", ids)))
    outs = run(d, {f"r{i}" for i in range(len(PROMPTS))})
    assert [tokens(outs[f"r{i}"]) for i in range(len(PROMPTS))] == reference
    after = d.stats().prompt_tokens_by_source["external_kv_transfer"]
    assert after - before == sum(len(x) - 1 for x in PROMPTS)
    assert d.stats().kv_transfer_failures == 0
    settle(p, d)  # every lease released once decode had read it
    assert p.stats().kv_leases_expired == 0


def test_1p1d_over_a_fake_nixl_agent_gives_identical_outputs(fake_pd, reference) -> None:
    fabric, p, d, pp, dp = fake_pd
    _identical_outputs(p, d, pp, dp, reference)
    assert fabric.count("register_memory") == 2  # once per engine, not per request
    # serve's default: NIXL's UCX thread pool, a READ split over its workers
    assert [a.backend_params["UCX"]["num_threads"] for a in fabric.agents.values()] == [
        str(DEFAULT_NIXL_THREADS)
    ] * 2


def test_1p1d_over_real_nixl_gives_identical_outputs(tiny_llama: Path, reference) -> None:
    if (why := _real_nixl_skip_reason()) is not None:
        pytest.skip(why)
    p, d, pp, dp = _pd(tiny_llama)
    try:
        _identical_outputs(p, d, pp, dp, reference)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_failed_nixl_read_fails_the_request_and_frees_prefill(fake_pd) -> None:
    fabric, p, d, pp, dp = fake_pd
    failures = d.stats().kv_transfer_failures
    ids = [401 + j for j in range(21)]  # no prefix of it is cached on decode: a real read
    fabric.fail = "transfer"
    try:
        params = prefill(p, pp, "x", ids)
        d.add_request(dp.make_request("x", ids, SamplingParams(max_tokens=4), params))
        out = run(d, {"x"})["x"][-1]
    finally:
        fabric.fail = None
    assert out.finish_reason == "error" and "NIXL READ" in (out.error or "")
    assert d.stats().kv_transfer_failures == failures + 1
    settle(p, d)  # decode's give-up notice released the lease (well before it expires)
    assert p.stats().kv_leases_expired == 0
