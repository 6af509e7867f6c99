"""Transport halves move block contents exactly (tcp on CPU and on a GPU, staged
through pinned memory there)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.transports.tcp import TcpClient, TcpServer


def _caches(device: str, dtype: torch.dtype, layers: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 10, 4, 2, 8, generator=g).to(dtype).to(device) for _ in range(layers)]


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tcp_roundtrip_copies_the_blocks(device: str, dtype: torch.dtype) -> None:
    src = _caches(device, dtype)
    dst = [torch.zeros_like(c) for c in src]
    remote, local = [7, 2, 3], [1, 5, 6]
    frames = [bytes(f) for f in TcpServer(src).read(remote)]  # as they arrive off a socket
    moved = TcpClient(dst, {}).write(remote, local, frames)
    assert moved == sum(c[:, :1].numel() * c.element_size() for c in src) * len(local)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, local], s[:, remote])
        untouched = [i for i in range(10) if i not in local]
        assert not d[:, untouched].any()
