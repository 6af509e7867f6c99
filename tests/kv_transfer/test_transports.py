"""Transport halves move block contents exactly, for every cache group with its own
layout and dtype (tcp on CPU and on a GPU, staged through pinned memory there;
cuda_ipc on a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _ipc_peer import filled_caches
from pdserve.core_types.cache_spec import CacheLayout, KVCacheConfig
from pdserve.forward_context import KVCaches
from pdserve.kv_transfer.transports.tcp import TcpClient, TcpServer

NUM_BLOCKS = 10


def _config(dtype: torch.dtype) -> KVCacheConfig:
    """A K/V group (block axis 1) and a small uint8 group (block axis 0)."""
    name = str(dtype).removeprefix("torch.")
    gqa = CacheLayout("gqa", name, (2, 1, 4, 2, 8), block_axis=1)
    codes = CacheLayout("codes", "uint8", (1, 4, 3), block_axis=0)
    return KVCacheConfig.from_layers(
        4,
        [
            ("l0.attn", "attn", gqa),
            ("l0.codes", "codes", codes),
            ("l1.attn", "attn", gqa),
            ("l2.attn", "attn", gqa),
        ],
    )


def _filled(cfg: KVCacheConfig, device: str) -> KVCaches:
    return filled_caches(cfg, NUM_BLOCKS, device, 0)


def _blocks(c: torch.Tensor, axis: int, ids: list[int]) -> torch.Tensor:
    return c.index_select(axis, torch.tensor(ids, device=c.device))


def _check_copied(src: KVCaches, dst: KVCaches, remote: list[int], local: list[int]) -> None:
    untouched = [i for i in range(NUM_BLOCKS) if i not in local]
    for (_, lay, s), (_, _, d) in zip(src.layers(), dst.layers(), strict=True):
        assert torch.equal(_blocks(d, lay.block_axis, local), _blocks(s, lay.block_axis, remote))
        assert not _blocks(d, lay.block_axis, untouched).any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tcp_roundtrip_copies_every_group(device: str, dtype: torch.dtype) -> None:
    cfg = _config(dtype)
    src = _filled(cfg, device)
    dst = KVCaches.allocate(cfg, NUM_BLOCKS, torch.device(device))
    remote, local = [7, 2, 3], [1, 5, 6]
    frames = [bytes(f) for f in TcpServer(src).read(remote)]  # as they arrive off a socket
    assert len(frames) == 4
    moved = TcpClient(dst, {}).write(remote, local, frames)
    assert moved == cfg.bytes_per_block * len(local)
    _check_copied(src, dst, remote, local)


def test_tcp_refuses_a_frame_of_the_wrong_size() -> None:
    cfg = _config(torch.float32)
    src = _filled(cfg, "cpu")
    frames = [bytes(f) for f in TcpServer(src).read([1, 2])]
    with pytest.raises(RuntimeError, match="bytes where"):
        TcpClient(KVCaches.allocate(cfg, NUM_BLOCKS, torch.device("cpu")), {}).write(
            [1, 2], [3], frames
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "remote,local,src",
    [
        ([7, 2, 3], [1, 5, 6], "cuda:0"),
        ([2, 3, 4], [5, 6, 7], "cuda:0"),
        ([7, 2, 3], [1, 5, 6], "cuda:1"),  # prefill on another GPU: a peer mapping
    ],
)
def test_cuda_ipc_copies_every_group(remote: list[int], local: list[int], src: str) -> None:
    """The exporting side runs in a child process (CUDA opens no IPC handle in the
    process that made it); both sides draw the same contents from one seed."""
    import multiprocessing as mp

    from _ipc_peer import export_caches
    from pdserve.kv_transfer.transports.cuda_ipc import CudaIpcClient

    if torch.device(src).index and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    cfg = _config(torch.bfloat16)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=export_caches, args=(cfg, NUM_BLOCKS, 0, child, src)
    )
    proc.start()
    try:
        assert parent.poll(120), "the exporting process did not answer"
        info = parent.recv()
        dst = KVCaches.allocate(cfg, NUM_BLOCKS, torch.device("cuda:0"))
        client = CudaIpcClient(dst, info)
        assert client.peer == (src != "cuda:0")
        moved = client.write(remote, local, [])
        assert moved == cfg.bytes_per_block * len(local)
        _check_copied(filled_caches(cfg, NUM_BLOCKS, "cuda", 0), dst, remote, local)
    finally:
        parent.send("stop")
        proc.join(30)


def test_cuda_ipc_on_a_cpu_cache_is_refused_when_opened() -> None:
    from pdserve.kv_transfer.transports import open_transport

    caches = KVCaches.allocate(_config(torch.float32), NUM_BLOCKS, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs the KV cache on a CUDA device.*tcp or nixl"):
        open_transport("cuda_ipc", caches)


def test_cuda_ipc_maps_on_decodes_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill's device number is its own; decode opens every handle on its device, tells
    one GPU from a peer by UUID, and refuses a visible pair without peer access."""
    from pdserve.kv_transfer.transports import cuda_ipc as ipc

    uuids = {0: "GPU-a", 1: "GPU-b"}
    peer_ok = {(0, 1): False}
    monkeypatch.setattr(ipc, "gpu_uuid", lambda d: uuids[d.index or 0])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: peer_ok[(a, b)])
    dev = torch.device("cuda", 0)
    assert ipc.check_peer(dev, None) is False  # an older prefill: no UUID sent
    assert ipc.check_peer(dev, "GPU-a") is False
    with pytest.raises(RuntimeError, match="no peer access.*tcp or nixl"):
        ipc.check_peer(dev, "GPU-b")
    peer_ok[(0, 1)] = True
    assert ipc.check_peer(dev, "GPU-b") is True
    assert ipc.check_peer(dev, "GPU-c") is True  # a GPU this process cannot see: CUDA maps it

    opened: list[int] = []

    def rebuild(*args: object) -> object:
        opened.append(args[6])  # type: ignore[arg-type]
        return SimpleNamespace(device=torch.device("cuda", args[6]))  # type: ignore[arg-type]

    monkeypatch.setattr(ipc, "rebuild_cuda_tensor", rebuild)
    d = {k: 0 for k in ("offset", "size_bytes", "offset_bytes", "rc_offset")}
    d |= {"size": [1], "stride": [1], "dtype": "bfloat16", "device": 5, "handle": b"h"}
    d |= {"rc_handle": b"r", "ev_handle": None, "ev_sync": False}
    assert ipc.import_tensor(d, torch.device("cuda", 1)).device == torch.device("cuda", 1)
    assert opened == [1]  # decode's device, not prefill's number (5)
