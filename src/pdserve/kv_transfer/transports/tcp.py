"""TCP transport: block contents travel as ZMQ frames, one per cache layer.

On a GPU the prefill side gathers the blocks on the device and copies them once into
pinned host memory (asynchronous DMA on a side stream); the decode side stages each
frame through pinned memory and copies it to the device the same way, its side stream
made to wait first (on the device) for the load's fence, the engine's work issued
before the load (``transports.base``). On the CPU the frames are views of the gathered
tensors (no extra copy before the socket). Each layer's blocks are gathered along its
own block axis, in its own dtype.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from pdserve.forward_context import KVCaches
from pdserve.kv_transfer.transports.base import (
    ClientTransport,
    Fence,
    ServerTransport,
    frame_view,
)


class TcpServer(ServerTransport):
    def __init__(self, kv_caches: KVCaches) -> None:
        super().__init__(kv_caches)
        dev = kv_caches.device
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def read(self, block_ids: list[int]) -> list[bytes | memoryview]:
        if not len(self.kv_caches):
            return []
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_caches.device)
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                host = []
                for _, layout, c in self.kv_caches.layers():
                    blocks = c.index_select(layout.block_axis, idx)
                    pinned = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
                    pinned.copy_(blocks, non_blocking=True)
                    host.append(pinned)
            self._stream.synchronize()
        else:
            host = [c.index_select(lay.block_axis, idx) for _, lay, c in self.kv_caches.layers()]
        return [t.contiguous().view(torch.uint8).numpy().data for t in host]


class TcpClient(ClientTransport):
    def __init__(self, kv_caches: KVCaches, transport_info: dict[str, Any]) -> None:
        super().__init__(kv_caches, transport_info)
        dev = kv_caches.device
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def order_after(self, after: Fence) -> None:
        if self._stream is None:  # (a CPU cache: no load carries a fence)
            super().order_after(after)
        else:
            after.wait(self._stream)  # on the device: the host does not block

    def write(
        self, remote_block_ids: list[int], local_block_ids: list[int], frames: list[Any]
    ) -> int:
        if len(frames) != len(self.kv_caches):
            raise RuntimeError(f"expected {len(self.kv_caches)} layer frames, got {len(frames)}")
        idx = torch.tensor(local_block_ids, dtype=torch.int64, device=self.kv_caches.device)
        moved = 0
        for (_, layout, cache), frame in zip(self.kv_caches.layers(), frames, strict=True):
            buf = frame.buffer if hasattr(frame, "buffer") else frame
            with warnings.catch_warnings():  # read-only socket buffer: we only read it
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(buf, dtype=torch.uint8)
            src = frame_view(raw, cache, layout.block_axis, len(local_block_ids))
            moved += raw.numel()
            if self._stream is not None:
                pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                pinned.copy_(src)
                with torch.cuda.stream(self._stream):
                    cache.index_copy_(
                        layout.block_axis, idx, pinned.to(cache.device, non_blocking=True)
                    )
            else:
                cache.index_copy_(layout.block_axis, idx, src)
        if self._stream is not None:
            self._stream.synchronize()
        return moved
