"""Block copies over every cache layer at once: the address math both the cuda_ipc kernel
and the nixl descriptors use, and its torch reference.

A *segment* is one contiguous stretch of a layer's cache holding ``num_blocks`` blocks
back to back: a tensor with its block axis at ``a`` is ``prod(shape[:a])`` segments (a
[2, blocks, ...] K/V tensor is two), each block ``prod(shape[a+1:]) * itemsize`` bytes
long. Block ``b`` of segment ``s`` starts at ``addr[s] + b * block_bytes[s]``. Both ends
of a transfer list their segments in :meth:`KVCaches.layers` order, so segment ``s``
of prefill pairs with segment ``s`` of decode (the handshake checked the layouts).

:func:`copy_blocks` moves the blocks ``src_ids[k] -> dst_ids[k]`` of every segment in
one launch of the Triton kernel ``kernels.kv_block_copy`` (a grid of blocks x
segments over the address tables of :class:`CopyPlan`); :func:`reference_copy` does
the same arithmetic with torch indexing on the tensors themselves, on any device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.forward_context import KVCaches


@dataclass(frozen=True)
class Segments:
    """Every segment of one instance's caches: start address, bytes per block, which
    layer (index in ``KVCaches.layers()`` order) it belongs to."""

    addrs: np.ndarray  # int64 [S]
    block_bytes: np.ndarray  # int64 [S]
    layer: np.ndarray  # int64 [S]
    num_blocks: int

    @classmethod
    def of(cls, kv_caches: KVCaches) -> Segments:
        return cls.from_layers([(n, lay.block_axis, c) for n, lay, c in kv_caches.layers()])

    @classmethod
    def from_layers(cls, layers: list[tuple[str, int, torch.Tensor]]) -> Segments:
        """From (name, block axis, tensor) of every layer, in ``KVCaches.layers()`` order."""
        addrs, sizes, layer = [], [], []
        counts = {c.shape[ax] for _, ax, c in layers}
        if len(counts) > 1:
            raise RuntimeError(f"cache layers of different block counts {sorted(counts)}")
        for i, (name, ax, c) in enumerate(layers):
            if not c.is_contiguous():
                raise RuntimeError(f"the KV cache of {name} is not contiguous")
            inner = math.prod(c.shape[ax + 1 :]) * c.element_size()
            for o in range(math.prod(c.shape[:ax])):
                addrs.append(c.data_ptr() + o * c.shape[ax] * inner)
                sizes.append(inner)
                layer.append(i)
        return cls(
            np.asarray(addrs, dtype=np.int64),
            np.asarray(sizes, dtype=np.int64),
            np.asarray(layer, dtype=np.int64),
            counts.pop() if counts else 0,
        )

    def to_info(self) -> dict:
        """A msgpack-friendly form (for a handshake payload)."""
        return {
            "addrs": self.addrs.tolist(),
            "block_bytes": self.block_bytes.tolist(),
            "layer": self.layer.tolist(),
            "num_blocks": self.num_blocks,
        }

    @classmethod
    def from_info(cls, d: dict) -> Segments:
        return cls(
            np.asarray(d["addrs"], dtype=np.int64),
            np.asarray(d["block_bytes"], dtype=np.int64),
            np.asarray(d["layer"], dtype=np.int64),
            int(d["num_blocks"]),
        )

    def check_pairs_with(self, other: Segments) -> None:
        """Refuse a pairing whose segments differ in count or block size."""
        if len(self.addrs) != len(other.addrs) or not np.array_equal(
            self.block_bytes, other.block_bytes
        ):
            raise RuntimeError(
                f"prefill and decode caches differ: {len(other.addrs)} segments of "
                f"{sorted(set(other.block_bytes.tolist()))} bytes a block against "
                f"{len(self.addrs)} of {sorted(set(self.block_bytes.tolist()))}"
            )


def check_ids(ids: list[int] | np.ndarray, num_blocks: int, side: str) -> np.ndarray:
    """Block ids as int64, or a RuntimeError if one is outside ``[0, num_blocks)``
    (a copy by address must never leave the caches)."""
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= num_blocks):
        raise RuntimeError(f"{side} block id out of range [0, {num_blocks}): {arr.tolist()}")
    return arr


def alignment(src: Segments, dst: Segments) -> int:
    """The largest power of two up to 16 dividing every address and block size of both
    ends."""
    g = int(np.gcd.reduce(np.concatenate([src.addrs, dst.addrs, src.block_bytes, [16]])))
    return g & -g


def unit_bytes(src: Segments, dst: Segments) -> int:
    """The widest element (8, 4, 2 or 1 bytes) dividing every address and block size of
    both ends: the kernel copies in units of it."""
    return min(8, alignment(src, dst))


@dataclass(frozen=True)
class CopyPlan:
    """The address tables of one (source, destination) pairing, made once (at the
    handshake): per segment its two start addresses and its block size in units."""

    src: Segments
    dst: Segments
    unit: int  # bytes
    aligned16: bool  # every address and block size a multiple of 16 bytes
    src_addrs: torch.Tensor  # int64 [S] on the device
    dst_addrs: torch.Tensor
    units: torch.Tensor  # int64 [S]: units per block

    @classmethod
    def make(cls, src: Segments, dst: Segments, device: torch.device) -> CopyPlan:
        dst.check_pairs_with(src)
        u = unit_bytes(src, dst)

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

        a16 = alignment(src, dst) == 16
        return cls(src, dst, u, a16, t(src.addrs), t(dst.addrs), t(src.block_bytes // u))

    def block_pairs(self, src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
        """int64 [2, B] on the host: source ids, destination ids (both range-checked)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
        return torch.from_numpy(
            np.stack(
                [
                    check_ids(src_ids, self.src.num_blocks, "source"),
                    check_ids(dst_ids, self.dst.num_blocks, "destination"),
                ]
            )
        )


def reference_copy(
    plan: CopyPlan,
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    src_ids: list[int],
    dst_ids: list[int],
) -> None:
    """What the kernel does, with torch indexing: for each segment, resolve its start
    address to (layer tensor, byte offset), and copy each block's ``units * unit``
    bytes from ``offset + id * block_bytes``. ``src``/``dst``: the layer tensors the
    plan's segments were taken from, in ``KVCaches.layers()`` order."""
    pairs = plan.block_pairs(src_ids, dst_ids)
    for s in range(len(plan.src.addrs)):
        n = int(plan.units[s]) * plan.unit  # bytes a block
        src_bytes, src_idx = _bytes_at(plan.src, src, s, pairs[0], n)
        dst_bytes, dst_idx = _bytes_at(plan.dst, dst, s, pairs[1], n)
        dst_bytes[dst_idx] = src_bytes[src_idx]


def _bytes_at(
    seg: Segments, tensors: list[torch.Tensor], s: int, ids: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment ``s``'s layer as flat bytes, and the byte offsets of blocks ``ids`` in it."""
    layer = tensors[int(seg.layer[s])]
    base = int(seg.addrs[s]) - layer.data_ptr()
    idx = (base + ids[:, None] * n + torch.arange(n)[None, :]).reshape(-1)
    return layer.view(-1).view(torch.uint8), idx.to(layer.device)


def upload_pairs(
    pairs: torch.Tensor, device: torch.device, stream: torch.cuda.Stream
) -> torch.Tensor:
    """The host ids ``pairs`` on ``device``: a pinned copy, uploaded on ``stream``."""
    with torch.cuda.stream(stream):
        return pairs.pin_memory().to(device, non_blocking=True)


def copy_blocks(
    plan: CopyPlan,
    pairs: torch.Tensor,
    stream: torch.cuda.Stream,
    step_bytes: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Enqueue on ``stream`` the copy of blocks ``pairs[0] -> pairs[1]`` (ids from
    :meth:`CopyPlan.block_pairs`) of every segment: one small host-to-device copy of
    the ids (:func:`upload_pairs`; none when ``pairs`` is already on the plan's device)
    and one kernel launch (the caller synchronises). ``step_bytes``, ``num_warps``: the
    kernel's launch shape (None: its defaults)."""
    from pdserve.kernels.kv_block_copy import copy_blocks_by_address

    dev = plan.units.device
    ids = pairs if pairs.device == dev else upload_pairs(pairs, dev, stream)
    with torch.cuda.stream(stream):
        copy_blocks_by_address(
            plan.src_addrs,
            plan.dst_addrs,
            plan.units,
            ids,
            plan.unit,
            plan.aligned16,
            step_bytes=step_bytes,
            num_warps=num_warps,
        )
