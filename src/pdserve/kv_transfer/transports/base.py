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


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Coalesce a block-id mapping into runs ``(src_start, dst_start, length)`` where both
    sides are consecutive, so each run is one slice copy instead of a gather + scatter."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs
