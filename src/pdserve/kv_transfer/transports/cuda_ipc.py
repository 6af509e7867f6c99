"""CUDA IPC transport (same host): decode maps prefill's cache tensors once, at the
handshake, and copies blocks device to device: every block of every layer and cache
group in one kernel launch over address tables made at the handshake
(``block_copy``). Nothing goes through host memory and the prefill side only answers
the control message.

Prefill and decode may be on one GPU or on two GPUs of the host. Prefill names its GPU
by UUID (process-local device numbers differ under ``CUDA_VISIBLE_DEVICES``), and decode
always opens the handles on its own device: on another GPU, CUDA maps the memory with
peer access enabled (NVLink or PCIe peer-to-peer, even for a GPU the decode process
cannot see), so the same copy kernel, launched on decode's device, reads prefill's
memory over the link. GPUs without peer access between them cannot map each other's
memory: the handshake then fails with a message pointing at ``tcp`` or ``nixl``. The
copy runs on a side stream, made to wait first (on the device) for the load's fence,
the engine's work issued before the load (``transports.base``); the puller sends the
peer's queued heartbeats and done notices while it runs, and reports the read once
the copy's event has completed.

Without Triton (or should its kernel fail to build) the copy falls back to torch:
slice to slice per layer and run of consecutive blocks, or one gather and one scatter
per layer for a fragmented mapping."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from pdserve.forward_context import KVCaches
from pdserve.kv_transfer.transports.base import (
    ClientTransport,
    Fence,
    PendingWrite,
    ServerTransport,
    block_runs,
)
from pdserve.kv_transfer.transports.block_copy import (
    CopyPlan,
    Segments,
    copy_blocks,
    upload_pairs,
)

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


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU's UUID (the same string in every process on the host)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def visible_index(uuid: str) -> int | None:
    """This process's number for the GPU with ``uuid``, if it can see that GPU."""
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(torch.device("cuda", i)) == uuid:
            return i
    return None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def check_peer(local_device: torch.device, remote_uuid: str | None) -> bool:
    """Whether prefill's GPU is another one than ``local_device`` (a peer mapping);
    refuses a visible GPU pair without peer access before any handle is opened."""
    if remote_uuid is None or remote_uuid == gpu_uuid(local_device):
        return False
    remote, local = visible_index(remote_uuid), _index(local_device)
    if remote is not None and not torch.cuda.can_device_access_peer(local, remote):
        raise RuntimeError(
            f"cuda_ipc: decode's GPU (cuda:{local}) has no peer access to prefill's GPU "
            f"(cuda:{remote}, {remote_uuid}); use transport tcp or nixl between them"
        )
    return True


def import_tensor(d: dict[str, Any], local_device: torch.device) -> torch.Tensor:
    """Map an exported tensor into ``local_device``'s address space: prefill's own
    device number means nothing here, the memory is opened on decode's device (mapped
    peer to peer when it lives on another GPU)."""
    index = _index(local_device)
    t = rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(d["size"]),
        tuple(d["stride"]),
        d["offset"],
        torch.storage.TypedStorage,
        getattr(torch, d["dtype"]),
        index,
        d["handle"],
        d["size_bytes"],
        d["offset_bytes"],
        False,
        d["rc_handle"],
        d["rc_offset"],
        d["ev_handle"],
        d["ev_sync"],
    )
    assert t.device.index == index, (t.device, index)
    return t


class CudaIpcServer(ServerTransport):
    def transport_info(self) -> dict[str, Any]:
        if not len(self.kv_caches) or self.kv_caches.device.type != "cuda":
            raise RuntimeError("the cuda_ipc transport needs the KV cache on a CUDA device")
        return {
            "layers": [export_tensor(c) for _, _, c in self.kv_caches.layers()],
            "gpu": gpu_uuid(self.kv_caches.device),
        }

    def read(self, block_ids: list[int]) -> list[bytes | memoryview]:
        return []  # the client copies from the mapped tensors itself


class CudaIpcClient(ClientTransport):
    reads_remote_memory = True
    # variants a benchmark switches (transfer_bench --variants): query the copy's event
    # right after the launch; the block-copy kernel's bytes a loop step and warps
    flush_launch = True
    copy_step: int | None = None  # None: kernels.kv_block_copy's defaults
    copy_warps: int | None = None

    def __init__(self, kv_caches: KVCaches, transport_info: dict[str, Any]) -> None:
        super().__init__(kv_caches, transport_info)
        dev = kv_caches.device
        if dev.type != "cuda":
            raise RuntimeError("the cuda_ipc transport needs the KV cache on a CUDA device")
        self.peer = check_peer(dev, transport_info.get("gpu"))
        try:
            self.remote = [import_tensor(d, dev) for d in transport_info["layers"]]
        except RuntimeError as e:
            if not self.peer:
                raise
            raise RuntimeError(
                f"cuda_ipc: decode's GPU ({dev}) could not map prefill's KV cache on GPU "
                f"{transport_info.get('gpu')} ({e}); GPUs without peer access between them "
                "need transport tcp or nixl"
            ) from e
        if self.peer:
            logger.info("cuda_ipc: prefill's cache is on another GPU, read peer to peer")
        if len(self.remote) != len(kv_caches):
            raise RuntimeError("prefill and decode have different cache layer counts")
        self._stream = torch.cuda.Stream(dev)
        # benchmarks set a list: each write appends its host times and timing events
        self.trace: list[dict[str, Any]] | None = None
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
        *,
        after: Fence | None = None,
    ) -> PendingWrite:
        """Enqueue the copy on the side stream (behind ``after``); the pending write's
        event completes it."""
        t0 = time.perf_counter()
        if after is not None:
            self.order_after(after)
        marks = None
        if self.trace is not None:  # timing events around the copy (benchmarks)
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            marks[0].record(self._stream)
        phases: list[float] = []  # host times after the ids' check and their upload
        if self.plan is not None:
            pairs = self.plan.block_pairs(remote_block_ids, local_block_ids)  # range-checked
            phases.append(time.perf_counter())
            ids = upload_pairs(pairs, self.kv_caches.device, self._stream)
            phases.append(time.perf_counter())
            try:
                copy_blocks(self.plan, ids, self._stream, self.copy_step, self.copy_warps)
            except Exception as e:  # a kernel that does not build: torch from now on
                logger.warning("cuda_ipc: the block-copy kernel failed (%s); copying with torch", e)
                self.plan = None
        if self.plan is None:
            self._copy_by_layer(remote_block_ids, local_block_ids)
        if marks is not None:
            marks[1].record(self._stream)
        done = torch.cuda.Event()
        done.record(self._stream)
        if self.flush_launch:
            # a query hands the queued launches to the GPU now (the caller is about to
            # block on a socket, not on this stream)
            done.query()
        if self.trace is not None and marks is not None:
            self.trace.append(
                {
                    "host_start": t0,
                    "host_launched": time.perf_counter(),
                    "events": marks,
                    "host_phases": phases,
                }
            )
        n = self.kv_caches.bytes_per_block() * len(local_block_ids)

        def wait() -> int:
            done.synchronize()
            return n

        return PendingWrite(wait, done.query)

    def order_after(self, after: Fence) -> None:
        after.wait(self._stream)  # on the device: the host does not block

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
