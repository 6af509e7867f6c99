"""TCP transport: block contents travel as ZMQ frames, one per layer.

On a GPU the prefill side gathers the blocks on the device and copies them once into
pinned host memory (asynchronous DMA on a side stream); the decode side stages each
frame through pinned memory and copies it to the device the same way. On the CPU the
frames are views of the gathered tensors (no extra copy before the socket).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from pdserve.kv_transfer.transports.base import ClientTransport, ServerTransport


class TcpServer(ServerTransport):
    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        super().__init__(kv_caches)
        dev = kv_caches[0].device if kv_caches else torch.device("cpu")
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def read(self, block_ids: list[int]) -> list[bytes | memoryview]:
        if not self.kv_caches:
            return []
        dev = self.kv_caches[0].device
        idx = torch.tensor(block_ids, dtype=torch.int64, device=dev)
        frames: list[bytes | memoryview] = []
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                host = []
                for c in self.kv_caches:
                    blocks = c.index_select(1, idx)
                    pinned = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
                    pinned.copy_(blocks, non_blocking=True)
                    host.append(pinned)
            self._stream.synchronize()
        else:
            host = [c.index_select(1, idx) for c in self.kv_caches]
        for t in host:
            frames.append(t.contiguous().view(torch.uint8).numpy().data)
        return frames


class TcpClient(ClientTransport):
    def __init__(self, kv_caches: list[torch.Tensor], transport_info: dict[str, Any]) -> None:
        super().__init__(kv_caches, transport_info)
        dev = kv_caches[0].device if kv_caches else torch.device("cpu")
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def write(
        self, remote_block_ids: list[int], local_block_ids: list[int], frames: list[Any]
    ) -> int:
        if len(frames) != len(self.kv_caches):
            raise RuntimeError(f"expected {len(self.kv_caches)} layer frames, got {len(frames)}")
        dev = self.kv_caches[0].device
        idx = torch.tensor(local_block_ids, dtype=torch.int64, device=dev)
        moved = 0
        for cache, frame in zip(self.kv_caches, frames, strict=True):
            buf = frame.buffer if hasattr(frame, "buffer") else frame
            with warnings.catch_warnings():  # read-only socket buffer: we only read it
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(buf, dtype=torch.uint8)
            src = raw.view(cache.dtype).view(cache.shape[0], len(local_block_ids), *cache.shape[2:])
            moved += raw.numel()
            if self._stream is not None:
                pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                pinned.copy_(src)
                with torch.cuda.stream(self._stream):
                    cache.index_copy_(1, idx, pinned.to(dev, non_blocking=True))
            else:
                cache.index_copy_(1, idx, src)
        if self._stream is not None:
            self._stream.synchronize()
        return moved
