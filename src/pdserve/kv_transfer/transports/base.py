"""The two halves of a transport, over every cache layer of every group.

Both ends iterate :meth:`KVCaches.layers` in the same order (the compatibility
handshake guarantees identical groups and layouts), and each layer's blocks are
selected along that layer's own block axis, in its own dtype.

The fence (decode side). A load may be given blocks freed while a step that still
writes into them is running: under async scheduling the step in flight was scheduled
before the requests it holds finished (or were aborted or preempted), and it writes
one KV slot into each one's last block after their blocks were freed. So a load on a
CUDA cache carries a :class:`Fence`, an event the connector recorded on the engine's
stream when it issued the load, and no byte of the load may be written before it has
completed: a client that enqueues its writes on a CUDA stream of its own (``cuda_ipc``,
``tcp`` on a GPU) makes that stream wait for it on the device (the copy is enqueued at
once, no host waits for the fence); any other (``nixl``: an RDMA READ the NIXL agent
posts, ordered on no stream; and the default) waits for it on the host, in the
puller's thread, before it posts anything. A load on a CPU cache carries none (the
engine's work there has finished when the load is issued).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from pdserve.forward_context import KVCaches


class Fence(Protocol):
    """Engine work a load must not overtake (a ``torch.cuda.Event`` recorded on the
    engine's stream when the load was issued)."""

    def wait(self, stream: torch.cuda.Stream) -> None:
        """Hold the work enqueued on ``stream`` from now on until the fence completes."""

    def synchronize(self) -> None:
        """Block the calling thread until the fence completes."""


class ServerTransport(ABC):
    """Prefill side."""

    def __init__(self, kv_caches: KVCaches) -> None:
        self.kv_caches = kv_caches

    def transport_info(self) -> dict[str, Any]:
        """Extra handshake payload (e.g. memory handles)."""
        return {}

    @abstractmethod
    def read(self, block_ids: list[int]) -> list[bytes | memoryview]:
        """Frames carrying these blocks of every layer (may be empty: the client copies)."""


class PendingWrite:
    """A write under way: :meth:`ready` polls it, :meth:`wait` completes it (the bytes
    moved, or the transfer's exception). The puller sends the peer's queued notices
    while a write is not ready."""

    def __init__(self, wait: Callable[[], int], ready: Callable[[], bool] | None = None) -> None:
        self._wait = wait
        self._ready = ready

    def ready(self) -> bool:
        return self._ready is None or self._ready()

    def wait(self) -> int:
        return self._wait()


class ClientTransport(ABC):
    """Decode side."""

    # the copy needs only prefill's block ids, no frames (it reads prefill's memory
    # itself): the link may start it before the read's reply arrives
    reads_remote_memory: ClassVar[bool] = False

    def __init__(self, kv_caches: KVCaches, transport_info: dict[str, Any]) -> None:
        self.kv_caches = kv_caches

    def begin_write(
        self,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        frames: list[Any],
        timeout: float = 60.0,
        *,
        after: Fence | None = None,
    ) -> PendingWrite:
        """Start :meth:`write`, no byte of it before ``after`` has completed (see the
        module docstring); transports that copy asynchronously return before the bytes
        have landed (the default writes at once)."""
        if after is not None:
            self.order_after(after)
        n = self.write(remote_block_ids, local_block_ids, frames)
        return PendingWrite(lambda: n)

    def order_after(self, after: Fence) -> None:
        """Hold this client's next writes until ``after`` has completed. The default
        blocks the calling thread (for writes that no CUDA stream orders); a client
        that enqueues its writes on a stream of its own makes that stream wait."""
        after.synchronize()

    def close(self) -> None:  # noqa: B027 (optional hook)
        """The connection this client served is gone (release what the handshake set up)."""

    @abstractmethod
    def write(
        self, remote_block_ids: list[int], local_block_ids: list[int], frames: list[Any]
    ) -> int:
        """Fill local blocks from the read's frames (or straight from remote memory);
        return the bytes moved. Must have completed (synchronised) when it returns."""


def frame_view(raw: torch.Tensor, like: torch.Tensor, axis: int, num_blocks: int) -> torch.Tensor:
    """A received frame's bytes viewed as ``num_blocks`` blocks of the layer ``like``
    (its dtype, its shape with ``num_blocks`` at ``axis``); a size mismatch raises."""
    shape = list(like.shape)
    shape[axis] = num_blocks
    want = like.element_size()
    for s in shape:
        want *= s
    if raw.numel() != want:
        raise RuntimeError(f"a KV frame of {raw.numel()} bytes where {want} were expected")
    return raw.view(like.dtype).view(shape)


def block_run_table(
    src_ids: list[int] | np.ndarray, dst_ids: list[int] | np.ndarray
) -> np.ndarray:
    """Coalesce a block-id mapping into runs where both sides are consecutive: an [N, 3]
    int64 table of ``(src_start, dst_start, length)``, so each run is one slice copy (or
    one descriptor) instead of a block each. Vectorised: a 64K-token prompt is 4,096
    blocks, and a Python loop over them cost ~0.5 ms of a READ's host time."""
    src = np.asarray(src_ids, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_ids, dtype=np.int64).reshape(-1)
    if src.size != dst.size:
        raise ValueError(f"{src.size} source blocks for {dst.size} destination blocks")
    if not src.size:
        return np.zeros((0, 3), dtype=np.int64)
    cut = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], cut))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return np.stack([src[starts], dst[starts], lengths], axis=1)


def block_runs(
    src_ids: list[int] | np.ndarray, dst_ids: list[int] | np.ndarray
) -> list[tuple[int, int, int]]:
    """:func:`block_run_table` as a list of ``(src_start, dst_start, length)`` tuples."""
    return [(int(s), int(d), int(n)) for s, d, n in block_run_table(src_ids, dst_ids).tolist()]
