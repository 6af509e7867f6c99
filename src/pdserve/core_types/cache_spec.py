"""What the KV cache holds, as the layers that own it declare it.

Every attention-like layer that keeps per-token state declares one
:class:`CacheLayout` (what its tensor looks like) under a group name. Layers of
one group have the same layout and share one attention backend and one metadata
object per step. All groups share the block tables: block ``b`` of a request means
block ``b`` in every layer's tensor, whatever its layout. A Llama layer keeps K and
V per KV head; a GLM-5 MLA layer keeps one latent vector per token; a DSA indexer
keeps a small key cache; an index-sharing layer keeps nothing (declares no spec).

The block pool only needs the total bytes per block; transports, the compatibility
handshake and warm-up read the per-group layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
    "int32": 4,
}


@dataclass(frozen=True)
class CacheLayout:
    """One layer's cache tensor: ``page_shape`` is one block's shape, with size 1 at
    ``block_axis``; the allocated tensor has ``num_blocks`` there. ``kind`` names what
    reads it (the backend family: "gqa", "mla", "indexer", ...)."""

    kind: str
    dtype: str
    page_shape: tuple[int, ...]
    block_axis: int

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"unsupported KV cache dtype {self.dtype!r}")
        if not 0 <= self.block_axis < len(self.page_shape) or self.page_shape[self.block_axis] != 1:
            raise ValueError(f"page_shape {self.page_shape} needs size 1 at axis {self.block_axis}")

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        s = list(self.page_shape)
        s[self.block_axis] = num_blocks
        return tuple(s)

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.page_shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    name: str
    layout: CacheLayout
    layer_names: tuple[str, ...]

    @property
    def bytes_per_block(self) -> int:
        return len(self.layer_names) * self.layout.bytes_per_block


@dataclass(frozen=True)
class KVCacheConfig:
    block_size: int
    groups: tuple[KVCacheGroupSpec, ...]

    @classmethod
    def from_layers(
        cls, block_size: int, layers: list[tuple[str, str, CacheLayout]]
    ) -> KVCacheConfig:
        """Group ``(layer name, group, layout)`` triples, in the order first seen; every
        layer of a group must declare the same layout."""
        groups: dict[str, tuple[CacheLayout, list[str]]] = {}
        for name, group, layout in layers:
            have = groups.setdefault(group, (layout, []))
            if have[0] != layout:
                raise ValueError(
                    f"layer {name} declares {layout} in cache group {group!r}, "
                    f"which holds {have[0]}"
                )
            have[1].append(name)
        return cls(
            block_size,
            tuple(KVCacheGroupSpec(g, lay, tuple(names)) for g, (lay, names) in groups.items()),
        )

    @property
    def bytes_per_block(self) -> int:
        return sum(g.bytes_per_block for g in self.groups)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_names) for g in self.groups)

    def num_blocks_for(self, budget_bytes: int) -> int:
        if not self.groups:
            return 0
        return max(0, budget_bytes // self.bytes_per_block)

    def describe(self) -> list[dict[str, Any]]:
        """The layouts as plain data (the P/D compatibility handshake compares these)."""
        return [
            {
                "group": g.name,
                "kind": g.layout.kind,
                "dtype": g.layout.dtype,
                "page_shape": list(g.layout.page_shape),
                "block_axis": g.layout.block_axis,
                "layers": list(g.layer_names),
            }
            for g in self.groups
        ]
