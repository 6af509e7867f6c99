"""The two halves of a transport."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class ServerTransport(ABC):
    """Prefill side. ``kv_caches[i]`` is layer i's cache, [2, blocks, block, heads, dim]."""

    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def transport_info(self) -> dict[str, Any]:
        """Extra handshake payload (e.g. memory handles)."""
        return {}

    @abstractmethod
    def read(self, block_ids: list[int]) -> list[bytes | memoryview]:
        """Frames carrying these blocks of every layer (may be empty: the client copies)."""


class ClientTransport(ABC):
    """Decode side."""

    def __init__(self, kv_caches: list[torch.Tensor], transport_info: dict[str, Any]) -> None:
        self.kv_caches = kv_caches

    @abstractmethod
    def write(
        self, remote_block_ids: list[int], local_block_ids: list[int], frames: list[Any]
    ) -> int:
        """Fill local blocks from the read's frames (or straight from remote memory);
        return the bytes moved. Must have completed (synchronised) when it returns."""


def frame_shape(cache: torch.Tensor, num_blocks: int) -> list[int]:
    return [cache.shape[0], num_blocks, *cache.shape[2:]]
