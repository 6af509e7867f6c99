"""Transport halves move block contents exactly, for every cache group with its own
layout and dtype (tcp on CPU and on a GPU, staged through pinned memory there;
cuda_ipc on a GPU)."""

from __future__ import annotations

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
@pytest.mark.parametrize("remote,local", [([7, 2, 3], [1, 5, 6]), ([2, 3, 4], [5, 6, 7])])
def test_cuda_ipc_copies_every_group(remote: list[int], local: list[int]) -> None:
    """The exporting side runs in a child process (CUDA opens no IPC handle in the
    process that made it); both sides draw the same contents from one seed."""
    import multiprocessing as mp

    from _ipc_peer import export_caches
    from pdserve.kv_transfer.transports.cuda_ipc import CudaIpcClient

    cfg = _config(torch.bfloat16)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=export_caches, args=(cfg, NUM_BLOCKS, 0, child))
    proc.start()
    try:
        assert parent.poll(120), "the exporting process did not answer"
        info = parent.recv()
        dst = KVCaches.allocate(cfg, NUM_BLOCKS, torch.device("cuda"))
        moved = CudaIpcClient(dst, info).write(remote, local, [])
        assert moved == cfg.bytes_per_block * len(local)
        _check_copied(filled_caches(cfg, NUM_BLOCKS, "cuda", 0), dst, remote, local)
    finally:
        parent.send("stop")
        proc.join(30)
