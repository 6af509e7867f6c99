"""CUDA IPC transport (same host): decode maps prefill's cache tensors once, at the
handshake, and copies blocks device to device: every block of every layer and cache
group in one kernel launch over address tables made at the handshake
(``block_copy``). Nothing goes through host memory and the prefill side only answers
the control message. The copy runs on a side stream; the puller sends the peer's
queued heartbeats and done notices while it runs, and reports the read once the
copy's event has completed.

Without Triton (or should its kernel fail to build) the copy falls back to torch:
slice to slice per layer and run of consecutive blocks, or one gather and one scatter
per layer for a fragmented mapping."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from pdserve.forward_context import KVCaches
from pdserve.kv_transfer.transports.base import (
    ClientTransport,
    PendingWrite,
    ServerTransport,
    block_runs,
)
from pdserve.kv_transfer.transports.block_copy import CopyPlan, Segments, copy_blocks

logger = logging.getLogger(__name__)

MAX_SLICE_RUNS = 16  # per layer (torch fallback); past this a gather + scatter is cheaper


def export_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A msgpack-friendly description of a CUDA tensor another process can map."""
    _, args = reduce_tensor(t)
    (
        _cls,
        size,
        stride,
        offset,
        _scls,
        dtype,
        device,
        handle,
        size_b,
        offset_b,
        _rg,
        rc_handle,
        rc_offset,
        ev_handle,
        ev_sync,
    ) = args
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": str(dtype).removeprefix("torch."),
        "device": int(device),
        "handle": bytes(handle),
        "size_bytes": int(size_b),
        "offset_bytes": int(offset_b),
        "rc_handle": bytes(rc_handle),
        "rc_offset": int(rc_offset),
        "ev_handle": bytes(ev_handle) if ev_handle is not None else None,
        "ev_sync": bool(ev_sync),
    }


def import_tensor(d: dict[str, Any], local_device: torch.device) -> torch.Tensor:
    t = rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(d["size"]),
        tuple(d["stride"]),
        d["offset"],
        torch.storage.TypedStorage,
        getattr(torch, d["dtype"]),
        d["device"],
        d["handle"],
        d["size_bytes"],
        d["offset_bytes"],
        False,
        d["rc_handle"],
        d["rc_offset"],
        d["ev_handle"],
        d["ev_sync"],
    )
    if t.device != local_device:
        raise RuntimeError(
            f"cuda_ipc maps prefill memory on {t.device}, decode runs on {local_device}"
        )
    return t


class CudaIpcServer(ServerTransport):
    def transport_info(self) -> dict[str, Any]:
        if not len(self.kv_caches) or self.kv_caches.device.type != "cuda":
            raise RuntimeError("the cuda_ipc transport needs the KV cache on a CUDA device")
        return {"layers": [export_tensor(c) for _, _, c in self.kv_caches.layers()]}

    def read(self, block_ids: list[int]) -> list[bytes | memoryview]:
        return []  # the client copies from the mapped tensors itself


class CudaIpcClient(ClientTransport):
    def __init__(self, kv_caches: KVCaches, transport_info: dict[str, Any]) -> None:
        super().__init__(kv_caches, transport_info)
        dev = kv_caches.device
        if dev.type != "cuda":
            raise RuntimeError("the cuda_ipc transport needs the KV cache on a CUDA device")
        self.remote = [import_tensor(d, dev) for d in transport_info["layers"]]
        if len(self.remote) != len(kv_caches):
            raise RuntimeError("prefill and decode have different cache layer counts")
        self._stream = torch.cuda.Stream(dev)
        axes = [(name, lay.block_axis) for name, lay, _ in kv_caches.layers()]
        remote = Segments.from_layers(
            [(n, ax, r) for (n, ax), r in zip(axes, self.remote, strict=True)]
        )
        self.plan: CopyPlan | None = CopyPlan.make(remote, Segments.of(kv_caches), dev)

    def write(
        self, remote_block_ids: list[int], local_block_ids: list[int], frames: list[Any]
    ) -> int:
        return self.begin_write(remote_block_ids, local_block_ids, frames).wait()

    def begin_write(
        self,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        frames: list[Any],
        timeout: float = 60.0,
    ) -> PendingWrite:
        """Enqueue the copy on the side stream; the pending write's event completes it."""
        if self.plan is not None:
            pairs = self.plan.block_pairs(remote_block_ids, local_block_ids)  # range-checked
            try:
                copy_blocks(self.plan, pairs, self._stream)
            except Exception as e:  # a kernel that does not build: torch from now on
                logger.warning("cuda_ipc: the block-copy kernel failed (%s); copying with torch", e)
                self.plan = None
        if self.plan is None:
            self._copy_by_layer(remote_block_ids, local_block_ids)
        done = torch.cuda.Event()
        done.record(self._stream)
        n = self.kv_caches.bytes_per_block() * len(local_block_ids)

        def wait() -> int:
            done.synchronize()
            return n

        return PendingWrite(wait, done.query)

    def _copy_by_layer(self, remote_block_ids: list[int], local_block_ids: list[int]) -> None:
        """Few runs of consecutive blocks on both sides are copied slice to slice, one
        pass over the bytes; a fragmented mapping falls back to a gather into a
        temporary and a scatter. Each layer is sliced along its own block axis."""
        dev = self.kv_caches.device
        runs = block_runs(remote_block_ids, local_block_ids)
        layers = [(lay.block_axis, c) for _, lay, c in self.kv_caches.layers()]
        with torch.cuda.stream(self._stream):
            if len(runs) <= MAX_SLICE_RUNS:
                for (ax, local), remote in zip(layers, self.remote, strict=True):
                    for r0, l0, n in runs:
                        local.narrow(ax, l0, n).copy_(remote.narrow(ax, r0, n), non_blocking=True)
            else:
                ridx = torch.tensor(remote_block_ids, dtype=torch.int64, device=dev)
                lidx = torch.tensor(local_block_ids, dtype=torch.int64, device=dev)
                for (ax, local), remote in zip(layers, self.remote, strict=True):
                    local.index_copy_(ax, lidx, remote.index_select(ax, ridx))
